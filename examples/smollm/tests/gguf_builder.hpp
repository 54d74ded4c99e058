// Test support: writes small GGUF (v3) images in memory, independently of the reader,
// plus encoders for the Q8_0 / Q4_1 blocks the dequantisers read.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "floe/core/numeric_types.hpp"

namespace smollm::testing {

class gguf_builder {
 public:
  std::uint32_t version = 3;
  std::uint64_t alignment = 32;

  gguf_builder& u32(const std::string& key, std::uint32_t v) { return scalar(key, 4, &v, 4); }
  gguf_builder& i32(const std::string& key, std::int32_t v) { return scalar(key, 5, &v, 4); }
  gguf_builder& f32(const std::string& key, float v) { return scalar(key, 6, &v, 4); }
  gguf_builder& boolean(const std::string& key, bool v) {
    const std::uint8_t b = v;
    return scalar(key, 7, &b, 1);
  }
  gguf_builder& u64(const std::string& key, std::uint64_t v) { return scalar(key, 10, &v, 8); }
  gguf_builder& i8(const std::string& key, std::int8_t v) { return scalar(key, 1, &v, 1); }
  gguf_builder& f64(const std::string& key, double v) { return scalar(key, 12, &v, 8); }
  gguf_builder& string(const std::string& key, const std::string& v) {
    ++n_kv_;
    put_string(kv_, key);
    put(kv_, std::uint32_t{8});
    put_string(kv_, v);
    return *this;
  }
  gguf_builder& strings(const std::string& key, const std::vector<std::string>& v) {
    ++n_kv_;
    put_string(kv_, key);
    put(kv_, std::uint32_t{9});
    put(kv_, std::uint32_t{8});
    put(kv_, static_cast<std::uint64_t>(v.size()));
    for (const auto& s : v) put_string(kv_, s);
    return *this;
  }
  gguf_builder& ints(const std::string& key, const std::vector<std::int32_t>& v) {
    ++n_kv_;
    put_string(kv_, key);
    put(kv_, std::uint32_t{9});
    put(kv_, std::uint32_t{5});
    put(kv_, static_cast<std::uint64_t>(v.size()));
    for (auto x : v) put(kv_, x);
    return *this;
  }
  // A tensor of dims (fastest first), ggml type id and raw bytes, placed at the next
  // aligned offset of the data region.
  gguf_builder& tensor(const std::string& name, std::vector<std::uint64_t> dims, std::uint32_t type,
                       const std::vector<std::uint8_t>& bytes) {
    ++n_tensors_;
    put_string(infos_, name);
    put(infos_, static_cast<std::uint32_t>(dims.size()));
    for (auto d : dims) put(infos_, d);
    put(infos_, type);
    while (data_.size() % alignment) data_.push_back(0);
    put(infos_, static_cast<std::uint64_t>(data_.size()));
    data_.insert(data_.end(), bytes.begin(), bytes.end());
    return *this;
  }

  std::vector<std::uint8_t> bytes() const {
    std::vector<std::uint8_t> out;
    put(out, std::uint32_t{0x46554747u});  // "GGUF"
    put(out, version);
    put(out, n_tensors_);
    put(out, n_kv_);
    out.insert(out.end(), kv_.begin(), kv_.end());
    out.insert(out.end(), infos_.begin(), infos_.end());
    while (out.size() % alignment) out.push_back(0);
    out.insert(out.end(), data_.begin(), data_.end());
    return out;
  }

  template <class T>
  static void put(std::vector<std::uint8_t>& out, T v) {
    std::uint8_t b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));
    out.insert(out.end(), b, b + sizeof(T));
  }
  static void put_string(std::vector<std::uint8_t>& out, const std::string& s) {
    put(out, static_cast<std::uint64_t>(s.size()));
    out.insert(out.end(), s.begin(), s.end());
  }

 private:
  gguf_builder& scalar(const std::string& key, std::uint32_t type, const void* v, std::size_t n) {
    ++n_kv_;
    put_string(kv_, key);
    put(kv_, type);
    const auto* p = static_cast<const std::uint8_t*>(v);
    kv_.insert(kv_.end(), p, p + n);
    return *this;
  }

  std::uint64_t n_kv_ = 0, n_tensors_ = 0;
  std::vector<std::uint8_t> kv_, infos_, data_;
};

inline void put_half(std::vector<std::uint8_t>& out, float x) {
  gguf_builder::put(out, floe::half::from_float(x).bits);
}
inline float half_round(float x) { return floe::half::from_float(x).to_float(); }

// Q8_0: per 32 values, d = max|x| / 127 (as f16), q = round(x / d).
inline std::vector<std::uint8_t> encode_q8_0(const std::vector<float>& x) {
  std::vector<std::uint8_t> out;
  for (std::size_t b = 0; b < x.size() / 32; ++b) {
    float amax = 0;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[32 * b + j]));
    const float d = half_round(amax / 127.f);
    put_half(out, d);
    for (int j = 0; j < 32; ++j)
      out.push_back(static_cast<std::uint8_t>(static_cast<std::int8_t>(d > 0 ? std::lround(x[32 * b + j] / d) : 0)));
  }
  return out;
}

// Q4_1: per 32 values, m = min, d = (max - min) / 15 (both f16), q = round((x - m) / d)
// clamped to [0, 15]; q[j] in the low nibble of byte j, q[j + 16] in its high nibble.
inline std::vector<std::uint8_t> encode_q4_1(const std::vector<float>& x) {
  std::vector<std::uint8_t> out;
  for (std::size_t b = 0; b < x.size() / 32; ++b) {
    float lo = x[32 * b], hi = x[32 * b];
    for (int j = 0; j < 32; ++j) lo = std::min(lo, x[32 * b + j]), hi = std::max(hi, x[32 * b + j]);
    const float d = half_round((hi - lo) / 15.f), m = half_round(lo);
    put_half(out, d);
    put_half(out, m);
    auto q = [&](int j) {
      const long v = d > 0 ? std::lround((x[32 * b + j] - m) / d) : 0;
      return static_cast<std::uint8_t>(std::clamp(v, 0L, 15L));
    };
    for (int j = 0; j < 16; ++j) out.push_back(static_cast<std::uint8_t>(q(j) | (q(j + 16) << 4)));
  }
  return out;
}

}  // namespace smollm::testing
