// A GGUF (version 2 and 3) reader: header, metadata key/values, tensor infos, and the
// tensor data region. Layout facts from the GGUF specification (ggml's docs/gguf.md):
// little-endian; strings are a u64 length plus bytes; tensor data starts at the next
// multiple of `general.alignment` (default 32) after the tensor infos.
#pragma once

#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "floe/core/error.hpp"
#include "quant.hpp"

namespace smollm {

enum class gguf_type : std::uint32_t {
  u8 = 0, i8 = 1, u16 = 2, i16 = 3, u32 = 4, i32 = 5, f32 = 6, boolean = 7, string = 8, array = 9,
  u64 = 10, i64 = 11, f64 = 12,
};

// One metadata value. Scalars are held as one-element arrays so that every value has the
// same shape; integers, floats and strings each keep their own exact storage.
struct gguf_value {
  gguf_type type = gguf_type::u8;  // the element type (for arrays: the type of the elements)
  bool is_array = false;
  std::vector<std::int64_t> ints;    // integer and boolean elements (u64 above 2^63 wraps; none seen)
  std::vector<double> floats;        // f32 and f64 elements
  std::vector<std::string> strings;  // string elements

  std::size_t size() const { return ints.size() + floats.size() + strings.size(); }
};

struct gguf_tensor {
  std::string name;
  std::vector<std::uint64_t> dims;  // dims[0] is the fastest-varying (row length)
  ggml_type type = ggml_type::f32;
  std::uint64_t offset = 0;         // from the start of the data region
  std::uint64_t bytes = 0;

  std::uint64_t elements() const {
    std::uint64_t n = 1;
    for (auto d : dims) n *= d;
    return n;
  }
  std::uint64_t row_length() const { return dims.empty() ? 1 : dims[0]; }
  std::uint64_t rows() const { return row_length() ? elements() / row_length() : 0; }
};

class gguf_file {
 public:
  static gguf_file open(const std::string& path) {
    std::ifstream in(path, std::ios::binary | std::ios::ate);
    floe::require(in.good(), "gguf", "cannot open '", path, "'");
    std::vector<std::uint8_t> bytes(static_cast<std::size_t>(in.tellg()));
    in.seekg(0);
    in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    floe::require(in.good(), "gguf", "cannot read '", path, "'");
    return parse(std::move(bytes));
  }

  static gguf_file parse(std::vector<std::uint8_t> bytes) {
    gguf_file f;
    f.bytes_ = std::move(bytes);
    f.read_all();
    return f;
  }

  std::uint32_t version() const { return version_; }
  const std::map<std::string, gguf_value>& metadata() const { return metadata_; }
  const std::vector<gguf_tensor>& tensors() const { return tensors_; }

  bool has(const std::string& key) const { return metadata_.count(key) != 0; }
  const gguf_value& at(const std::string& key) const {
    auto it = metadata_.find(key);
    floe::require(it != metadata_.end(), "gguf", "metadata key '", key, "' is missing");
    return it->second;
  }
  std::int64_t get_int(const std::string& key) const {
    const auto& v = at(key);
    floe::require(!v.is_array && v.ints.size() == 1, "gguf", "metadata key '", key, "' is not an integer");
    return v.ints[0];
  }
  double get_float(const std::string& key) const {
    const auto& v = at(key);
    floe::require(!v.is_array && v.size() == 1 && v.strings.empty(), "gguf", "metadata key '", key,
                  "' is not a number");
    return v.floats.empty() ? static_cast<double>(v.ints[0]) : v.floats[0];
  }
  const std::string& get_string(const std::string& key) const {
    const auto& v = at(key);
    floe::require(!v.is_array && v.strings.size() == 1, "gguf", "metadata key '", key, "' is not a string");
    return v.strings[0];
  }

  const gguf_tensor* find_tensor(const std::string& name) const {
    for (const auto& t : tensors_)
      if (t.name == name) return &t;
    return nullptr;
  }
  const gguf_tensor& tensor(const std::string& name) const {
    const gguf_tensor* t = find_tensor(name);
    floe::require(t != nullptr, "gguf", "tensor '", name, "' is missing");
    return *t;
  }
  std::span<const std::uint8_t> data(const gguf_tensor& t) const {
    return {bytes_.data() + data_start_ + t.offset, static_cast<std::size_t>(t.bytes)};
  }

  // The whole tensor as floats, row-major [rows, row_length].
  std::vector<float> dequantize(const gguf_tensor& t) const {
    std::vector<float> out(t.elements());
    const std::uint64_t row_bytes = t.bytes / std::max<std::uint64_t>(t.rows(), 1);
    for (std::uint64_t r = 0; r < t.rows(); ++r)
      dequantize_row(t.type, data(t).subspan(r * row_bytes, row_bytes), out.data() + r * t.row_length(),
                     t.row_length(), t.name);
    return out;
  }

 private:
  template <class T>
  T read_pod() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, bytes_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  void need(std::uint64_t n) const {
    floe::require(n <= bytes_.size() && pos_ <= bytes_.size() - n, "gguf", "file truncated at byte ", pos_,
                  " (", n, " more bytes needed, file has ", bytes_.size(), ")");
  }
  std::string read_string() {
    const auto n = read_pod<std::uint64_t>();
    need(n);
    std::string s(reinterpret_cast<const char*>(bytes_.data() + pos_), static_cast<std::size_t>(n));
    pos_ += n;
    return s;
  }

  void read_element(gguf_type t, gguf_value& v, const std::string& key) {
    switch (t) {
      case gguf_type::u8: v.ints.push_back(read_pod<std::uint8_t>()); break;
      case gguf_type::i8: v.ints.push_back(read_pod<std::int8_t>()); break;
      case gguf_type::u16: v.ints.push_back(read_pod<std::uint16_t>()); break;
      case gguf_type::i16: v.ints.push_back(read_pod<std::int16_t>()); break;
      case gguf_type::u32: v.ints.push_back(read_pod<std::uint32_t>()); break;
      case gguf_type::i32: v.ints.push_back(read_pod<std::int32_t>()); break;
      case gguf_type::u64: v.ints.push_back(static_cast<std::int64_t>(read_pod<std::uint64_t>())); break;
      case gguf_type::i64: v.ints.push_back(read_pod<std::int64_t>()); break;
      case gguf_type::boolean: v.ints.push_back(read_pod<std::uint8_t>() != 0); break;
      case gguf_type::f32: v.floats.push_back(read_pod<float>()); break;
      case gguf_type::f64: v.floats.push_back(read_pod<double>()); break;
      case gguf_type::string: v.strings.push_back(read_string()); break;
      default:
        floe::require(false, "gguf", "metadata key '", key, "' has unknown value type ",
                      static_cast<std::uint32_t>(t));
    }
  }

  void read_all() {
    floe::require(read_pod<std::uint32_t>() == 0x46554747u, "gguf", "bad magic: not a GGUF file");
    version_ = read_pod<std::uint32_t>();
    floe::require(version_ == 2 || version_ == 3, "gguf", "unsupported GGUF version ", version_,
                  " (2 and 3 are supported)");
    const auto n_tensors = read_pod<std::uint64_t>();
    const auto n_kv = read_pod<std::uint64_t>();
    // Each entry takes at least 8 bytes, so a count beyond the file size is corrupt.
    floe::require(n_tensors <= bytes_.size() && n_kv <= bytes_.size(), "gguf", "implausible counts: ",
                  n_tensors, " tensors, ", n_kv, " metadata keys");

    for (std::uint64_t i = 0; i < n_kv; ++i) {
      std::string key = read_string();
      gguf_value v;
      auto t = static_cast<gguf_type>(read_pod<std::uint32_t>());
      if (t == gguf_type::array) {
        v.is_array = true;
        t = static_cast<gguf_type>(read_pod<std::uint32_t>());
        floe::require(t != gguf_type::array, "gguf", "metadata key '", key, "': nested arrays are not supported");
        const auto count = read_pod<std::uint64_t>();
        floe::require(count <= bytes_.size() - pos_, "gguf", "metadata key '", key, "': array of ", count,
                      " elements does not fit in the file");
        for (std::uint64_t j = 0; j < count; ++j) read_element(t, v, key);
      } else {
        read_element(t, v, key);
      }
      v.type = t;
      metadata_[key] = std::move(v);
    }

    for (std::uint64_t i = 0; i < n_tensors; ++i) {
      gguf_tensor t;
      t.name = read_string();
      const auto n_dims = read_pod<std::uint32_t>();
      floe::require(n_dims >= 1 && n_dims <= 4, "gguf", "tensor '", t.name, "' has ", n_dims, " dimensions");
      for (std::uint32_t d = 0; d < n_dims; ++d) t.dims.push_back(read_pod<std::uint64_t>());
      t.type = static_cast<ggml_type>(read_pod<std::uint32_t>());
      t.offset = read_pod<std::uint64_t>();
      t.bytes = tensor_bytes(t.type, t.row_length(), t.rows(), t.name);
      tensors_.push_back(std::move(t));
    }

    std::uint64_t alignment = 32;
    if (has("general.alignment")) alignment = static_cast<std::uint64_t>(get_int("general.alignment"));
    floe::require(alignment > 0 && (alignment & (alignment - 1)) == 0, "gguf", "general.alignment = ", alignment,
                  " is not a power of two");
    data_start_ = (pos_ + alignment - 1) / alignment * alignment;
    for (const auto& t : tensors_) {
      floe::require(t.offset % alignment == 0, "gguf", "tensor '", t.name, "' offset ", t.offset,
                    " is not aligned to ", alignment);
      floe::require(data_start_ <= bytes_.size() && t.offset <= bytes_.size() - data_start_ &&
                        t.bytes <= bytes_.size() - data_start_ - t.offset,
                    "gguf", "tensor '", t.name, "' (", t.bytes, " bytes at offset ", t.offset,
                    ") runs past the end of the file");
    }
  }

  std::vector<std::uint8_t> bytes_;
  std::uint64_t pos_ = 0, data_start_ = 0;
  std::uint32_t version_ = 0;
  std::map<std::string, gguf_value> metadata_;
  std::vector<gguf_tensor> tensors_;
};

}  // namespace smollm
