// Writes C-order little-endian .npy files (format 1.0) of float32 or int32: enough for
// KV dumps (docs/kv-format.md) and the logits the NumPy reference check reads.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>
#include <type_traits>
#include <vector>

#include "floe/core/error.hpp"

namespace smollm {

template <class T>
void write_npy(const std::string& path, const T* data, const std::vector<std::size_t>& shape) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, std::int32_t>, "float32 or int32 only");
  floe::require(!shape.empty(), "shape", "a .npy array here has at least one dimension");
  std::string dims;
  std::size_t count = 1;
  for (std::size_t s : shape) dims += std::to_string(s) + ", ", count *= s;
  dims.resize(dims.size() - (shape.size() == 1 ? 1 : 2));  // "(a,)" and "(a, b)"
  std::string header = std::string("{'descr': '") + (std::is_same_v<T, float> ? "<f4" : "<i4") +
                       "', 'fortran_order': False, 'shape': (" + dims + "), }";
  // Magic (6) + version (2) + length (2) + header + '\n' is padded to a multiple of 64.
  header.append(63 - (10 + header.size()) % 64, ' ');
  header += '\n';
  std::ofstream out(path, std::ios::binary);
  floe::require(out.good(), "output", "cannot write '", path, "'");
  out.write("\x93NUMPY\x01\x00", 8);
  const auto len = static_cast<std::uint16_t>(header.size());
  const char len_bytes[2] = {static_cast<char>(len & 0xFF), static_cast<char>(len >> 8)};
  out.write(len_bytes, 2);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(count * sizeof(T)));
  floe::require(out.good(), "output", "failed writing '", path, "'");
}

}  // namespace smollm
