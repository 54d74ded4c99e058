// A small JSON value with a strict parser and a writer, enough for the meta.json of a KV
// dump (docs/kv-format.md). Objects keep their keys in file order.
#pragma once

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "floe/core/error.hpp"

namespace floe::io {

class json {
 public:
  using array = std::vector<json>;
  using object = std::vector<std::pair<std::string, json>>;

  json() = default;  // null
  json(std::nullptr_t) {}
  json(bool b) : v_(b) {}
  json(double x) : v_(x) {}
  json(int x) : v_(static_cast<double>(x)) {}
  json(long x) : v_(static_cast<double>(x)) {}
  json(unsigned long x) : v_(static_cast<double>(x)) {}
  json(const char* s) : v_(std::string(s)) {}
  json(std::string s) : v_(std::move(s)) {}
  json(array a) : v_(std::make_shared<array>(std::move(a))) {}
  json(object o) : v_(std::make_shared<object>(std::move(o))) {}

  bool is_null() const { return std::holds_alternative<std::monostate>(v_); }
  bool is_bool() const { return std::holds_alternative<bool>(v_); }
  bool is_number() const { return std::holds_alternative<double>(v_); }
  bool is_string() const { return std::holds_alternative<std::string>(v_); }
  bool is_array() const { return std::holds_alternative<std::shared_ptr<array>>(v_); }
  bool is_object() const { return std::holds_alternative<std::shared_ptr<object>>(v_); }

  bool as_bool() const { return std::get<bool>(v_); }
  double as_number() const { return std::get<double>(v_); }
  const std::string& as_string() const { return std::get<std::string>(v_); }
  const array& as_array() const { return *std::get<std::shared_ptr<array>>(v_); }
  const object& as_object() const { return *std::get<std::shared_ptr<object>>(v_); }

  // The member `key` of an object, or nullptr (also when this is not an object).
  const json* find(std::string_view key) const {
    if (!is_object()) return nullptr;
    for (const auto& [k, v] : as_object())
      if (k == key) return &v;
    return nullptr;
  }

  // Compact text; numbers with enough digits to read back the same double.
  std::string dump() const {
    std::string out;
    write(out);
    return out;
  }

  // Parses one JSON text; `source` names it in errors (e.g. the file path).
  static json parse(std::string_view text, const std::string& source) {
    parser p{text, 0, source};
    p.skip_space();
    json v = p.value(0);
    p.skip_space();
    if (p.pos != text.size()) p.fail("unexpected text after the JSON value");
    return v;
  }

 private:
  std::variant<std::monostate, bool, double, std::string, std::shared_ptr<array>, std::shared_ptr<object>> v_;

  static void write_string(std::string& out, const std::string& s) {
    out += '"';
    for (unsigned char c : s) {
      if (c == '"' || c == '\\') {
        out += '\\';
        out += static_cast<char>(c);
      } else if (c < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\u%04x", c);
        out += buf;
      } else {
        out += static_cast<char>(c);
      }
    }
    out += '"';
  }

  void write(std::string& out) const {
    if (is_null()) out += "null";
    else if (is_bool()) out += as_bool() ? "true" : "false";
    else if (is_number()) {
      const double x = as_number();
      if (!std::isfinite(x)) {
        out += "null";  // JSON has no NaN or Inf
      } else {
        char buf[32];
        std::snprintf(buf, sizeof buf, "%.17g", x);
        out += buf;
      }
    } else if (is_string()) write_string(out, as_string());
    else if (is_array()) {
      out += '[';
      for (std::size_t i = 0; i < as_array().size(); ++i) {
        if (i) out += ", ";
        as_array()[i].write(out);
      }
      out += ']';
    } else {
      out += '{';
      bool first = true;
      for (const auto& [k, v] : as_object()) {
        if (!first) out += ", ";
        first = false;
        write_string(out, k);
        out += ": ";
        v.write(out);
      }
      out += '}';
    }
  }

  struct parser {
    std::string_view text;
    std::size_t pos;
    const std::string& source;

    [[noreturn]] void fail(const std::string& what) const {
      throw invalid_argument(source, floe::detail::concat("invalid JSON at byte ", pos, ": ", what));
    }
    void skip_space() {
      while (pos < text.size() && (text[pos] == ' ' || text[pos] == '\n' || text[pos] == '\r' || text[pos] == '\t'))
        ++pos;
    }
    bool take(std::string_view word) {
      if (text.substr(pos, word.size()) != word) return false;
      pos += word.size();
      return true;
    }
    json value(int depth) {
      if (depth > 64) fail("nested too deeply");
      if (pos >= text.size()) fail("unexpected end of text");
      const char c = text[pos];
      if (c == '{') return json(members(depth));
      if (c == '[') return json(elements(depth));
      if (c == '"') return json(string());
      if (take("true")) return json(true);
      if (take("false")) return json(false);
      if (take("null")) return json();
      return json(number());
    }
    object members(int depth) {
      object o;
      ++pos;
      skip_space();
      if (take("}")) return o;
      for (;;) {
        skip_space();
        if (pos >= text.size() || text[pos] != '"') fail("expected a quoted key");
        std::string key = string();
        skip_space();
        if (!take(":")) fail("expected ':' after a key");
        skip_space();
        o.emplace_back(std::move(key), value(depth + 1));
        skip_space();
        if (take("}")) return o;
        if (!take(",")) fail("expected ',' or '}' in an object");
      }
    }
    array elements(int depth) {
      array a;
      ++pos;
      skip_space();
      if (take("]")) return a;
      for (;;) {
        skip_space();
        a.push_back(value(depth + 1));
        skip_space();
        if (take("]")) return a;
        if (!take(",")) fail("expected ',' or ']' in an array");
      }
    }
    double number() {
      const std::size_t start = pos;
      if (pos < text.size() && text[pos] == '-') ++pos;
      const std::size_t digits = pos;
      while (pos < text.size() && ((text[pos] >= '0' && text[pos] <= '9') || text[pos] == '.' || text[pos] == 'e' ||
                                   text[pos] == 'E' || text[pos] == '+' || text[pos] == '-'))
        ++pos;
      if (pos == digits || text[digits] < '0' || text[digits] > '9') {
        pos = start;
        fail("expected a value");
      }
      const std::string s(text.substr(start, pos - start));
      char* end = nullptr;
      const double x = std::strtod(s.c_str(), &end);
      if (end != s.c_str() + s.size()) {
        pos = start;
        fail(floe::detail::concat("malformed number '", s, "'"));
      }
      return x;
    }
    static void append_utf8(std::string& out, unsigned cp) {
      if (cp < 0x80) out += static_cast<char>(cp);
      else if (cp < 0x800) {
        out += static_cast<char>(0xc0 | (cp >> 6));
        out += static_cast<char>(0x80 | (cp & 0x3f));
      } else if (cp < 0x10000) {
        out += static_cast<char>(0xe0 | (cp >> 12));
        out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
        out += static_cast<char>(0x80 | (cp & 0x3f));
      } else {
        out += static_cast<char>(0xf0 | (cp >> 18));
        out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
        out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
        out += static_cast<char>(0x80 | (cp & 0x3f));
      }
    }
    unsigned hex4() {
      if (pos + 4 > text.size()) fail("truncated \\u escape");
      unsigned v = 0;
      for (int i = 0; i < 4; ++i) {
        const char h = text[pos++];
        v <<= 4;
        if (h >= '0' && h <= '9') v |= static_cast<unsigned>(h - '0');
        else if (h >= 'a' && h <= 'f') v |= static_cast<unsigned>(h - 'a' + 10);
        else if (h >= 'A' && h <= 'F') v |= static_cast<unsigned>(h - 'A' + 10);
        else fail("bad hex digit in a \\u escape");
      }
      return v;
    }
    std::string string() {
      std::string out;
      ++pos;
      for (;;) {
        if (pos >= text.size()) fail("unterminated string");
        const char c = text[pos++];
        if (c == '"') return out;
        if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string");
        if (c != '\\') {
          out += c;
          continue;
        }
        if (pos >= text.size()) fail("unterminated escape");
        const char e = text[pos++];
        switch (e) {
          case '"': out += '"'; break;
          case '\\': out += '\\'; break;
          case '/': out += '/'; break;
          case 'b': out += '\b'; break;
          case 'f': out += '\f'; break;
          case 'n': out += '\n'; break;
          case 'r': out += '\r'; break;
          case 't': out += '\t'; break;
          case 'u': {
            unsigned cp = hex4();
            if (cp >= 0xd800 && cp < 0xdc00 && take("\\u")) {  // surrogate pair
              const unsigned lo = hex4();
              cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
            }
            append_utf8(out, cp);
            break;
          }
          default: fail(std::string("unknown escape \\") + e);
        }
      }
    }
  };
};

}  // namespace floe::io
