// Byte-level BPE (GPT-2 style) from a GGUF's `tokenizer.ggml.tokens` and `.merges`, with
// the pre-tokenizer SmolLM2 uses (GGUF `tokenizer.ggml.pre` = "smollm"): every digit is
// its own piece, then GPT-2's split
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// Character classes are exact for ASCII and Latin-1/Latin Extended, approximate beyond
// (unicode_class below); the texts used here are ASCII.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "floe/core/error.hpp"
#include "gguf.hpp"

namespace smollm {

enum class char_class { letter, number, space, other };

inline char_class unicode_class(std::uint32_t c) {
  if (c < 0x80) {
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return char_class::letter;
    if (c >= '0' && c <= '9') return char_class::number;
    if (c == ' ' || (c >= 0x09 && c <= 0x0D)) return char_class::space;
    return char_class::other;
  }
  if (c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 ||
      c == 0x202F || c == 0x205F || c == 0x3000)
    return char_class::space;
  if (c == 0xB2 || c == 0xB3 || c == 0xB9 || (c >= 0xBC && c <= 0xBE) || (c >= 0x660 && c <= 0x669) ||
      (c >= 0x6F0 && c <= 0x6F9) || (c >= 0x966 && c <= 0x96F) || (c >= 0x2070 && c <= 0x2089) ||
      (c >= 0x2150 && c <= 0x2189) || (c >= 0x2460 && c <= 0x249B) || (c >= 0xFF10 && c <= 0xFF19))
    return char_class::number;
  if (c == 0xAA || c == 0xB5 || c == 0xBA || (c >= 0xC0 && c <= 0x2C1 && c != 0xD7 && c != 0xF7) ||
      (c >= 0x370 && c <= 0x3FF && c != 0x375 && c != 0x37E && c != 0x384 && c != 0x385 && c != 0x387) ||
      (c >= 0x400 && c <= 0x52F && !(c >= 0x482 && c <= 0x489)) || (c >= 0x531 && c <= 0x587) ||
      (c >= 0x5D0 && c <= 0x5EA) || (c >= 0x620 && c <= 0x64A) || (c >= 0x1E00 && c <= 0x1FFF) ||
      (c >= 0x3041 && c <= 0x30FF) || (c >= 0x3400 && c <= 0x4DBF) || (c >= 0x4E00 && c <= 0x9FFF) ||
      (c >= 0xAC00 && c <= 0xD7A3) || (c >= 0xF900 && c <= 0xFAFF) || (c >= 0xFF21 && c <= 0xFF3A) ||
      (c >= 0xFF41 && c <= 0xFF5A) || (c >= 0x20000 && c <= 0x2FFFF))
    return char_class::letter;
  return char_class::other;
}

class bpe_tokenizer {
 public:
  static bpe_tokenizer from_gguf(const gguf_file& f) {
    const std::string& model = f.get_string("tokenizer.ggml.model");
    floe::require(model == "gpt2", "tokenizer", "tokenizer.ggml.model is '", model,
                  "'; only byte-level BPE ('gpt2') is supported");
    const auto& types = f.has("tokenizer.ggml.token_type") ? f.at("tokenizer.ggml.token_type").ints
                                                           : std::vector<std::int64_t>{};
    const int unk = f.has("tokenizer.ggml.unknown_token_id") ? static_cast<int>(f.get_int("tokenizer.ggml.unknown_token_id"))
                                                             : -1;
    return bpe_tokenizer(f.at("tokenizer.ggml.tokens").strings, f.at("tokenizer.ggml.merges").strings, types, unk);
  }

  // token_types: GGUF token types (3 = control, 4 = user-defined are matched literally
  // in the input); may be empty. A byte without a token of its own becomes `unknown`
  // (an error if that is -1).
  bpe_tokenizer(std::vector<std::string> tokens, const std::vector<std::string>& merges,
                const std::vector<std::int64_t>& token_types, int unknown = -1)
      : tokens_(std::move(tokens)), unknown_(unknown) {
    floe::require(!tokens_.empty(), "tokenizer", "the vocabulary is empty");
    floe::require(unknown >= -1 && unknown < static_cast<int>(tokens_.size()), "tokenizer", "unknown token id ",
                  unknown, " is outside the vocabulary");
    floe::require(token_types.empty() || token_types.size() == tokens_.size(), "tokenizer", token_types.size(),
                  " token types for ", tokens_.size(), " tokens");
    for (std::size_t i = 0; i < tokens_.size(); ++i) {
      ids_.emplace(tokens_[i], static_cast<int>(i));
      if (!token_types.empty() && (token_types[i] == 3 || token_types[i] == 4)) specials_.push_back(static_cast<int>(i));
    }
    init_byte_map();
    for (int b = 0; b < 256; ++b) {
      auto it = ids_.find(byte_chars_[b]);
      byte_ids_[b] = it == ids_.end() ? -1 : it->second;
    }
    for (std::size_t r = 0; r < merges.size(); ++r) {
      const std::string& m = merges[r];
      const auto space = m.find(' ');
      floe::require(space != std::string::npos && space > 0 && space + 1 < m.size(), "tokenizer", "merge ", r,
                    " ('", m, "') is not two tokens separated by a space");
      const int a = id_of(m.substr(0, space), r), b = id_of(m.substr(space + 1), r);
      const int ab = id_of(m.substr(0, space) + m.substr(space + 1), r);
      merges_.emplace(pair_key(a, b), merge_rule{static_cast<int>(r), ab});
    }
  }

  std::size_t vocab_size() const { return tokens_.size(); }
  const std::string& token(int id) const {
    floe::require(id >= 0 && static_cast<std::size_t>(id) < tokens_.size(), "token", "id ", id,
                  " is outside the vocabulary of ", tokens_.size());
    return tokens_[static_cast<std::size_t>(id)];
  }

  std::vector<int> encode(std::string_view text) const {
    std::vector<int> out;
    std::size_t start = 0;
    while (start < text.size()) {
      // The earliest special token in the rest of the text (longest if two start together).
      std::size_t at = text.size(), len = 0;
      int special = -1;
      for (int id : specials_) {
        const std::string& s = tokens_[static_cast<std::size_t>(id)];
        const auto p = text.find(s, start);
        if (p != std::string_view::npos && (p < at || (p == at && s.size() > len))) at = p, len = s.size(), special = id;
      }
      encode_plain(text.substr(start, at - start), out);
      if (special < 0) break;
      out.push_back(special);
      start = at + len;
    }
    return out;
  }

  // The bytes a token stands for.
  std::string decode(int id) const {
    const std::string& t = token(id);
    std::string out;
    for (std::size_t i = 0; i < t.size();) {
      const std::size_t n = utf8_length(static_cast<unsigned char>(t[i]));
      auto it = char_bytes_.find(t.substr(i, n));
      if (it == char_bytes_.end()) return t;  // not byte-level (e.g. a special token): as is
      out.push_back(static_cast<char>(it->second));
      i += n;
    }
    return out;
  }
  std::string decode(const std::vector<int>& ids) const {
    std::string out;
    for (int id : ids) out += decode(id);
    return out;
  }

 private:
  struct merge_rule {
    int rank, result;
  };
  struct codepoint {
    std::uint32_t value;
    std::size_t begin, end;  // bytes in the text
  };

  static std::uint64_t pair_key(int a, int b) {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) | static_cast<std::uint32_t>(b);
  }
  int id_of(const std::string& s, std::size_t merge) const {
    auto it = ids_.find(s);
    floe::require(it != ids_.end(), "tokenizer", "merge ", merge, " uses '", s, "', which is not in the vocabulary");
    return it->second;
  }
  static std::size_t utf8_length(unsigned char lead) {
    return lead < 0x80 ? 1 : (lead >> 5) == 0x6 ? 2 : (lead >> 4) == 0xE ? 3 : (lead >> 3) == 0x1E ? 4 : 1;
  }
  static std::string utf8(std::uint32_t c) {
    std::string s;
    if (c < 0x80) {
      s += static_cast<char>(c);
    } else if (c < 0x800) {
      s += static_cast<char>(0xC0 | (c >> 6));
      s += static_cast<char>(0x80 | (c & 0x3F));
    } else {
      s += static_cast<char>(0xE0 | (c >> 12));
      s += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
      s += static_cast<char>(0x80 | (c & 0x3F));
    }
    return s;
  }

  // GPT-2's reversible byte -> printable character map: printable Latin-1 bytes stand
  // for themselves, the other 68 bytes for U+0100 onwards in byte order.
  void init_byte_map() {
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      byte_chars_[b] = utf8(static_cast<std::uint32_t>(printable ? b : next++));
      char_bytes_.emplace(byte_chars_[b], static_cast<std::uint8_t>(b));
    }
  }

  // Decodes UTF-8; a malformed byte becomes a codepoint of its own (class `other`).
  static std::vector<codepoint> codepoints(std::string_view s) {
    std::vector<codepoint> out;
    for (std::size_t i = 0; i < s.size();) {
      const auto lead = static_cast<unsigned char>(s[i]);
      std::size_t n = utf8_length(lead);
      std::uint32_t c = lead;
      bool ok = n > 1 && i + n <= s.size();
      if (ok) {
        c = lead & (0x7F >> n);
        for (std::size_t k = 1; k < n; ++k) {
          const auto cont = static_cast<unsigned char>(s[i + k]);
          ok = ok && (cont & 0xC0) == 0x80;
          c = (c << 6) | (cont & 0x3F);
        }
      }
      if (!ok) n = 1, c = lead < 0x80 ? lead : 0xFFFD;
      out.push_back({c, i, i + n});
      i += n;
    }
    return out;
  }

  // Splits cps[begin, end) with the GPT-2 pattern, calling word(first cp, last cp + 1).
  template <class F>
  static void split_gpt2(const std::vector<codepoint>& cps, std::size_t begin, std::size_t end, F&& word) {
    auto cls = [&](std::size_t i) { return unicode_class(cps[i].value); };
    auto cp = [&](std::size_t i) { return i < end ? cps[i].value : 0u; };
    std::size_t i = begin;
    while (i < end) {
      std::size_t j = i;
      if (cp(i) == '\'') {  // contractions, lower case only, as in GPT-2
        const std::uint32_t a = cp(i + 1), b = cp(i + 2);
        if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) j = i + 3;
        else if (a == 's' || a == 't' || a == 'm' || a == 'd') j = i + 2;
      }
      if (j == i) {
        const std::size_t k = (cp(i) == ' ' && i + 1 < end) ? i + 1 : i;
        const char_class c = cls(k);
        if (c != char_class::space) {  // ` ?X+` for X in letter, number, other
          j = k + 1;
          while (j < end && cls(j) == c) ++j;
        } else {  // whitespace: leave the last one to the next word unless at the end
          std::size_t run = i;
          while (run < end && cls(run) == char_class::space) ++run;
          j = (run < end && run - i >= 2) ? run - 1 : run;
        }
      }
      word(i, j);
      i = j;
    }
  }

  void encode_plain(std::string_view text, std::vector<int>& out) const {
    const auto cps = codepoints(text);
    auto emit = [&](std::size_t a, std::size_t b) {
      if (a < b) bpe(text.substr(cps[a].begin, cps[b - 1].end - cps[a].begin), out);
    };
    std::size_t run = 0;  // digits are pieces of their own; the rest goes through GPT-2's split
    for (std::size_t i = 0; i <= cps.size(); ++i) {
      if (i == cps.size() || unicode_class(cps[i].value) == char_class::number) {
        split_gpt2(cps, run, i, emit);
        if (i < cps.size()) emit(i, i + 1);
        run = i + 1;
      }
    }
  }

  // Byte-level BPE of one word: repeatedly merge the adjacent pair of lowest rank.
  void bpe(std::string_view word, std::vector<int>& out) const {
    auto cached = cache_.find(std::string(word));
    if (cached != cache_.end()) {
      out.insert(out.end(), cached->second.begin(), cached->second.end());
      return;
    }
    std::vector<int> syms;
    for (char ch : word) {
      const int id = byte_ids_[static_cast<unsigned char>(ch)];
      floe::require(id >= 0 || unknown_ >= 0, "text", "byte ", static_cast<int>(static_cast<unsigned char>(ch)),
                    " has no token and the vocabulary has no unknown token");
      syms.push_back(id >= 0 ? id : unknown_);
    }
    while (syms.size() > 1) {
      int best_rank = -1, best_result = -1;
      std::size_t best = 0;
      for (std::size_t k = 0; k + 1 < syms.size(); ++k) {
        auto it = merges_.find(pair_key(syms[k], syms[k + 1]));
        if (it != merges_.end() && (best_rank < 0 || it->second.rank < best_rank))
          best_rank = it->second.rank, best_result = it->second.result, best = k;
      }
      if (best_rank < 0) break;
      syms[best] = best_result;
      syms.erase(syms.begin() + static_cast<std::ptrdiff_t>(best) + 1);
    }
    out.insert(out.end(), syms.begin(), syms.end());
    if (cache_.size() < 100000) cache_.emplace(std::string(word), std::move(syms));
  }

  std::vector<std::string> tokens_;
  int unknown_ = -1;
  std::unordered_map<std::string, int> ids_;
  std::vector<int> specials_;
  std::array<std::string, 256> byte_chars_;
  std::unordered_map<std::string, std::uint8_t> char_bytes_;
  std::array<int, 256> byte_ids_{};
  std::unordered_map<std::uint64_t, merge_rule> merges_;
  mutable std::unordered_map<std::string, std::vector<int>> cache_;
};

}  // namespace smollm
