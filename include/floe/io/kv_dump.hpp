// KV dumps on disk: one directory per layer with keys.npy [Hkv, N, d], values.npy
// [Hkv, N, dv], queries.npy [Hq, Q, d] and an optional meta.json. The format is
// docs/kv-format.md; every inconsistency is rejected naming the file.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "floe/core/kv_view.hpp"
#include "floe/core/numeric_types.hpp"
#include "floe/core/query.hpp"
#include "floe/io/json.hpp"
#include "floe/io/npy.hpp"

namespace floe::io {

// The keys and values of every KV head of one layer, in one element type.
template <KvElement T>
struct kv_arrays {
  std::vector<T> keys;    // [Hkv, N, d]
  std::vector<T> values;  // [Hkv, N, dv]
};

// One layer's cache and the decode-step queries that follow it.
struct kv_dump {
  index_t kv_heads = 0, n = 0, d = 0, dv = 0, q_heads = 0, steps = 0;
  std::variant<kv_arrays<float>, kv_arrays<half>, kv_arrays<bfloat16>> kv;
  std::vector<float> queries;  // [Hq, Q, d]: query head h, decode step t at (h * Q + t) * d
  float scale = 0.f;           // softmax scale: meta.json "scale", else 1/sqrt(d)
  json meta = json(json::object{});

  index_t group() const { return q_heads / kv_heads; }
  std::string_view dtype_name() const {
    return std::visit([](const auto& a) { return element_name<typename std::decay_t<decltype(a.keys)>::value_type>(); },
                      kv);
  }
  index_t element_bytes() const {
    return std::visit([](const auto& a) { return sizeof(typename std::decay_t<decltype(a.keys)>::value_type); }, kv);
  }

  // Calls f(kv_view<T>) on KV head h.
  template <class F>
  decltype(auto) visit_head(index_t h, F&& f) const {
    require(h < kv_heads, "kv_head", "head ", h, " of a dump with ", kv_heads, " KV heads");
    return std::visit(
        [&](const auto& a) -> decltype(auto) {
          using T = typename std::decay_t<decltype(a.keys)>::value_type;
          return f(kv_view<T>(a.keys.data() + h * n * d, a.values.data() + h * n * dv, n, d, dv));
        },
        kv);
  }

  // The g query heads of KV head h at decode step t (rows Q * d apart).
  query_group queries_of(index_t h, index_t t) const {
    return {queries.data() + (h * group() * steps + t) * d, group(), d, steps * d, scale};
  }
};

namespace detail {

inline std::string meta_dtype(const json& meta, const std::string& file) {
  const json* t = meta.find("dtype");
  if (!t) return {};
  if (!t->is_string()) throw invalid_argument(file, "\"dtype\" must be a string");
  const std::string& s = t->as_string();
  if (s != "float32" && s != "float16" && s != "bfloat16")
    fail_in_file(file, "\"dtype\" is \"", s, "\"; expected \"float32\", \"float16\" or \"bfloat16\"");
  return s;
}

// The element type an array holds, from its npy dtype and meta.json's "dtype" (which
// describes keys and values; queries may be float32 whatever it says).
inline std::string element_type_of(const npy_array& a, const std::string& declared, const std::string& file,
                                   const std::string& meta_file, bool is_query) {
  const std::string from_npy = a.dtype == npy_dtype::f32 ? "float32" : a.dtype == npy_dtype::f16 ? "float16" : "";
  if (a.dtype == npy_dtype::word16) {
    if (declared != "bfloat16")
      fail_in_file(file, "holds 16-bit integer words; that means bfloat16 only when ", meta_file,
               " says \"dtype\": \"bfloat16\"");
    return "bfloat16";
  }
  if (!declared.empty() && declared != from_npy && !(is_query && from_npy == "float32"))
    fail_in_file(file, "holds ", from_npy, " but ", meta_file, " says \"dtype\": \"", declared, "\"");
  return from_npy;
}

template <KvElement T>
std::vector<T> elements_as(const npy_array& a, const std::string& file) {
  const index_t count = a.elements();
  std::vector<T> out(count);
  for (index_t i = 0; i < count; ++i) {
    float x;
    if (a.dtype == npy_dtype::f32) std::memcpy(&x, a.data.data() + 4 * i, 4);
    else {
      std::uint16_t w;
      std::memcpy(&w, a.data.data() + 2 * i, 2);
      x = a.dtype == npy_dtype::f16 ? half::from_bits(w).to_float() : bfloat16::from_bits(w).to_float();
    }
    if (!std::isfinite(x)) fail_in_file(file, "element ", i, " is NaN or Inf");
    if constexpr (std::is_same_v<T, float>) out[i] = x;
    else out[i] = T::from_float(x);  // exact: the source already has this type
  }
  return out;
}

inline void require_rank3(const npy_array& a, const std::string& file, const char* layout) {
  if (a.shape.size() != 3)
    fail_in_file(file, "has rank ", a.shape.size(), "; expected 3, ", layout);
  if (a.elements() == 0) fail_in_file(file, "is empty; expected ", layout);
}

}  // namespace detail

// Reads one layer directory.
inline kv_dump load_kv_dump(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  const auto file = [&](const char* name) { return (dir / name).string(); };
  if (!fs::is_directory(dir)) throw invalid_argument(dir.string(), "is not a directory");

  kv_dump out;
  const std::string meta_file = file("meta.json");
  if (fs::exists(dir / "meta.json")) {
    std::ifstream in(dir / "meta.json", std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    out.meta = json::parse(text, meta_file);
    if (!out.meta.is_object()) throw invalid_argument(meta_file, "must hold a JSON object");
  }
  const std::string declared = detail::meta_dtype(out.meta, meta_file);

  const npy_array keys = read_npy(dir / "keys.npy");
  const npy_array values = read_npy(dir / "values.npy");
  const npy_array queries = read_npy(dir / "queries.npy");
  detail::require_rank3(keys, file("keys.npy"), "[Hkv, N, d]");
  detail::require_rank3(values, file("values.npy"), "[Hkv, N, dv]");
  detail::require_rank3(queries, file("queries.npy"), "[Hq, Q, d]");

  out.kv_heads = keys.shape[0];
  out.n = keys.shape[1];
  out.d = keys.shape[2];
  out.dv = values.shape[2];
  out.q_heads = queries.shape[0];
  out.steps = queries.shape[1];
  if (values.shape[0] != out.kv_heads || values.shape[1] != out.n)
    detail::fail_in_file(file("values.npy"), "has shape [", values.shape[0], ", ", values.shape[1],
                     ", dv]; keys.npy has [", out.kv_heads, ", ", out.n, ", d]");
  if (queries.shape[2] != out.d)
    detail::fail_in_file(file("queries.npy"), "has d = ", queries.shape[2], "; keys.npy has d = ", out.d);
  if (out.q_heads % out.kv_heads != 0)
    detail::fail_in_file(file("queries.npy"), "has ", out.q_heads, " query heads, not a multiple of the ",
                     out.kv_heads, " KV heads");

  const std::string kt = detail::element_type_of(keys, declared, file("keys.npy"), meta_file, false);
  const std::string vt = detail::element_type_of(values, declared, file("values.npy"), meta_file, false);
  if (kt != vt) detail::fail_in_file(file("values.npy"), "holds ", vt, " but keys.npy holds ", kt);
  detail::element_type_of(queries, declared, file("queries.npy"), meta_file, true);

  const auto fill = [&]<KvElement T>(std::type_identity<T>) {
    out.kv = kv_arrays<T>{detail::elements_as<T>(keys, file("keys.npy")),
                          detail::elements_as<T>(values, file("values.npy"))};
  };
  if (kt == "float32") fill(std::type_identity<float>{});
  else if (kt == "float16") fill(std::type_identity<half>{});
  else fill(std::type_identity<bfloat16>{});
  out.queries = detail::elements_as<float>(queries, file("queries.npy"));

  out.scale = 1.f / std::sqrt(static_cast<float>(out.d));
  if (const json* s = out.meta.find("scale")) {
    if (!s->is_number() || !std::isfinite(s->as_number()) || !(s->as_number() > 0))
      throw invalid_argument(meta_file, "\"scale\" must be a finite positive number");
    out.scale = static_cast<float>(s->as_number());
  }
  return out;
}

// Writes one layer directory (created if missing): keys and values in the dump's element
// type (bfloat16 as uint16 words), queries in float32, and meta.json with "dtype" and
// "scale" set from the dump.
inline void save_kv_dump(const std::filesystem::path& dir, const kv_dump& dump) {
  std::filesystem::create_directories(dir);
  const index_t kshape[3] = {dump.kv_heads, dump.n, dump.d};
  const index_t vshape[3] = {dump.kv_heads, dump.n, dump.dv};
  const index_t qshape[3] = {dump.q_heads, dump.steps, dump.d};
  std::visit(
      [&](const auto& a) {
        using T = typename std::decay_t<decltype(a.keys)>::value_type;
        write_npy<T>(dir / "keys.npy", a.keys, kshape);
        write_npy<T>(dir / "values.npy", a.values, vshape);
      },
      dump.kv);
  write_npy<float>(dir / "queries.npy", dump.queries, qshape);

  const std::string_view t = dump.dtype_name();
  json::object meta;
  meta.emplace_back("dtype", t == "f32" ? "float32" : t == "f16" ? "float16" : "bfloat16");
  meta.emplace_back("scale", static_cast<double>(dump.scale));
  if (dump.meta.is_object())
    for (const auto& [k, v] : dump.meta.as_object())
      if (k != "dtype" && k != "scale") meta.emplace_back(k, v);
  std::ofstream out(dir / "meta.json", std::ios::trunc);
  out << json(std::move(meta)).dump() << "\n";
  if (!out) throw invalid_argument((dir / "meta.json").string(), "write failed");
}

// The layer directories of a dump: `dir` itself when it holds keys.npy, else its
// layer_* subdirectories in numeric order.
inline std::vector<std::filesystem::path> kv_dump_layers(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(dir)) throw invalid_argument(dir.string(), "is not a directory");
  if (fs::exists(dir / "keys.npy")) return {dir};
  std::vector<std::pair<long, fs::path>> layers;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (!e.is_directory() || name.rfind("layer_", 0) != 0) continue;
    const std::string digits = name.substr(6);
    if (digits.empty() || !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
      continue;
    layers.emplace_back(std::stol(digits), e.path());
  }
  if (layers.empty()) throw invalid_argument(dir.string(), "holds neither keys.npy nor layer_XX/ directories");
  std::sort(layers.begin(), layers.end());
  std::vector<fs::path> out;
  for (auto& l : layers) out.push_back(std::move(l.second));
  return out;
}

}  // namespace floe::io
