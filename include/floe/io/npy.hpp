// NumPy .npy files (format versions 1.0, 2.0, 3.0): read and write C-order arrays of
// float32, float16 and 16-bit words (how bfloat16 travels, see docs/kv-format.md).
// Every malformed file gets a floe::invalid_argument naming the file.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <span>
#include <string>
#include <type_traits>
#include <string_view>
#include <vector>

#include "floe/core/config.hpp"
#include "floe/core/error.hpp"
#include "floe/core/numeric_types.hpp"

namespace floe::io {

static_assert(std::endian::native == std::endian::little, "floe::io reads and writes little-endian .npy data");

// Element types floe reads: float32, IEEE float16, and raw 16-bit words (bfloat16 bits,
// stored by NumPy as uint16 / int16 / void16 because it has no bfloat16).
enum class npy_dtype { f32, f16, word16 };

inline std::string_view npy_dtype_name(npy_dtype t) {
  switch (t) {
    case npy_dtype::f32: return "float32";
    case npy_dtype::f16: return "float16";
    case npy_dtype::word16: return "16-bit words";
  }
  return "?";
}

inline index_t npy_dtype_size(npy_dtype t) { return t == npy_dtype::f32 ? 4 : 2; }

struct npy_array {
  npy_dtype dtype = npy_dtype::f32;
  std::vector<index_t> shape;
  std::vector<unsigned char> data;  // little-endian elements, C order

  index_t elements() const {
    index_t e = 1;
    for (index_t s : shape) e *= s;
    return e;
  }
};

namespace detail {

// Message parts are joined by a stream: GCC 12 warns falsely (-Wrestrict) on string + chains.
template <class... Parts>
[[noreturn]] void fail_in_file(const std::string& file, const Parts&... parts) {
  throw invalid_argument(file, floe::detail::concat(parts...));
}

inline std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\n')) s.remove_suffix(1);
  return s;
}

// The text of `'key': value` in the header dict: a quoted string, a tuple, or a bare word.
inline std::string_view npy_dict_value(std::string_view header, std::string_view key, const std::string& file) {
  const std::string quoted = floe::detail::concat("'", key, "'");
  const auto at = header.find(quoted);
  if (at == std::string_view::npos) fail_in_file(file, "header has no '", key, "' entry");
  auto rest = trim(header.substr(at + quoted.size()));
  if (rest.empty() || rest.front() != ':') fail_in_file(file, "header entry '", key, "' has no ':'");
  rest = trim(rest.substr(1));
  if (!rest.empty() && (rest.front() == '(' || rest.front() == '\'' || rest.front() == '"')) {
    const char close = rest.front() == '(' ? ')' : rest.front();
    const auto end = rest.find(close, 1);
    if (end == std::string_view::npos) fail_in_file(file, "header entry '", key, "' is not terminated");
    return rest.substr(0, end + 1);
  }
  return trim(rest.substr(0, rest.find_first_of(",}")));
}

inline npy_dtype parse_npy_descr(std::string_view descr, const std::string& file) {
  if (descr.size() < 2 || (descr.front() != '\'' && descr.front() != '"'))
    fail_in_file(file, "header 'descr' is not a string: ", descr);
  descr = descr.substr(1, descr.size() - 2);
  if (descr == "<f4") return npy_dtype::f32;
  if (descr == "<f2") return npy_dtype::f16;
  if (descr == "<u2" || descr == "<i2" || descr == "|V2" || descr == "<V2") return npy_dtype::word16;
  if (descr.size() == 3 && descr.front() == '>')
    fail_in_file(file, "dtype '", descr, "' is big-endian; floe reads little-endian arrays only");
  fail_in_file(file, "unsupported dtype '", descr,
           "'; floe reads float32 ('<f4'), float16 ('<f2') and 16-bit words for bfloat16 ('<u2')");
}

inline std::vector<index_t> parse_npy_shape(std::string_view shape, const std::string& file) {
  if (shape.size() < 2 || shape.front() != '(' || shape.back() != ')')
    fail_in_file(file, "header 'shape' is not a tuple: ", shape);
  std::vector<index_t> dims;
  std::string_view body = shape.substr(1, shape.size() - 2);
  while (!(body = trim(body)).empty()) {
    const auto comma = body.find(',');
    const auto item = trim(body.substr(0, comma));
    if (item.empty()) fail_in_file(file, "header 'shape' has an empty entry: ", shape);
    index_t v = 0;
    for (char c : item) {
      if (c < '0' || c > '9') fail_in_file(file, "header 'shape' entry '", item, "' is not a count");
      const index_t next = v * 10 + static_cast<index_t>(c - '0');
      if (next / 10 != v) fail_in_file(file, "header 'shape' entry '", item, "' overflows");
      v = next;
    }
    dims.push_back(v);
    if (comma == std::string_view::npos) break;
    body = body.substr(comma + 1);
  }
  return dims;
}

}  // namespace detail

// Parses a complete .npy image held in memory. `file` names it in errors.
inline npy_array parse_npy(std::span<const unsigned char> bytes, const std::string& file) {
  using detail::fail_in_file;
  static constexpr unsigned char magic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
  if (bytes.size() < 10 || std::memcmp(bytes.data(), magic, 6) != 0)
    fail_in_file(file, "not a .npy file (the magic string \\x93NUMPY is missing)");
  const unsigned major = bytes[6];
  if (major < 1 || major > 3) fail_in_file(file, "unsupported .npy format version ", major);  // unsigned: prints as a number
  const index_t len_bytes = major == 1 ? 2 : 4;
  if (bytes.size() < 8 + len_bytes) fail_in_file(file, "truncated header");
  index_t header_len = 0;
  for (index_t b = 0; b < len_bytes; ++b) header_len |= static_cast<index_t>(bytes[8 + b]) << (8 * b);
  const index_t offset = 8 + len_bytes + header_len;
  if (bytes.size() < offset) fail_in_file(file, "truncated header (needs ", offset, " bytes)");
  const std::string_view header(reinterpret_cast<const char*>(bytes.data() + 8 + len_bytes), header_len);
  const auto body = detail::trim(header);
  if (body.empty() || body.front() != '{' || body.back() != '}')
    fail_in_file(file, "header is not a Python dict literal");

  npy_array out;
  out.dtype = detail::parse_npy_descr(detail::npy_dict_value(body, "descr", file), file);
  const auto order = detail::npy_dict_value(body, "fortran_order", file);
  if (order == "True") fail_in_file(file, "array is in Fortran order; floe reads C-order arrays only");
  if (order != "False") fail_in_file(file, "header 'fortran_order' is neither True nor False");
  out.shape = detail::parse_npy_shape(detail::npy_dict_value(body, "shape", file), file);

  const index_t expected = out.elements() * npy_dtype_size(out.dtype);
  const index_t have = bytes.size() - offset;
  if (have < expected)
    fail_in_file(file, "truncated data: ", have, " bytes for ", out.elements(), " elements of ",
             npy_dtype_name(out.dtype), " (", expected, " bytes)");
  if (have > expected)
    fail_in_file(file, have - expected, " bytes after the data: the header's shape does not match");
  out.data.assign(bytes.begin() + static_cast<std::ptrdiff_t>(offset), bytes.end());
  return out;
}

inline npy_array read_npy(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw invalid_argument(path.string(), "cannot open the file");
  const std::vector<unsigned char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return parse_npy(bytes, path.string());
}

// The bytes of a version 1.0 .npy file holding `count` elements of `dtype` in C order;
// the header is padded so that the data starts at a multiple of 64 bytes.
inline std::vector<unsigned char> make_npy(npy_dtype dtype, std::span<const index_t> shape, const void* data) {
  index_t count = 1;
  for (index_t x : shape) count *= x;
  std::string shape_text = "(";
  for (index_t i = 0; i < shape.size(); ++i) shape_text += (i ? ", " : "") + std::to_string(shape[i]);
  shape_text += shape.size() == 1 ? ",)" : ")";
  const char* descr = dtype == npy_dtype::f32 ? "<f4" : dtype == npy_dtype::f16 ? "<f2" : "<u2";
  std::string header = floe::detail::concat("{'descr': '", descr, "', 'fortran_order': False, 'shape': ", shape_text, ", }");
  const index_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header += '\n';
  require(header.size() <= 0xffff, "shape", "too many dimensions for a version 1.0 header");

  std::vector<unsigned char> out = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
  out.push_back(static_cast<unsigned char>(header.size() & 0xff));
  out.push_back(static_cast<unsigned char>(header.size() >> 8));
  out.insert(out.end(), header.begin(), header.end());
  const auto* p = static_cast<const unsigned char*>(data);
  out.insert(out.end(), p, p + count * npy_dtype_size(dtype));
  return out;
}

inline void write_file(const std::filesystem::path& path, std::span<const unsigned char> bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw invalid_argument(path.string(), "cannot create the file");
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw invalid_argument(path.string(), "write failed");
}

// Writes float, half or bfloat16 (as 16-bit words) elements in C order.
template <KvElement T>
void write_npy(const std::filesystem::path& path, std::span<const T> elements, std::span<const index_t> shape) {
  index_t count = 1;
  for (index_t s : shape) count *= s;
  require(count == elements.size(), "shape", "describes ", count, " elements, ", elements.size(), " given");
  const npy_dtype dtype = std::is_same_v<T, float> ? npy_dtype::f32
                          : std::is_same_v<T, half> ? npy_dtype::f16
                                                     : npy_dtype::word16;
  write_file(path, make_npy(dtype, shape, elements.data()));
}

}  // namespace floe::io
