// KV dumps: save/load round trips in every element type, multi-layer discovery, and every
// inconsistency between the three arrays and meta.json rejected naming the file.
#include <catch2/catch.hpp>

#include <fstream>
#include <string>
#include <vector>

#include "floe/io/kv_dump.hpp"
#include "support/random_kv.hpp"
#include "temp_dir.hpp"

using namespace floe;

namespace {

template <KvElement T>
io::kv_dump random_dump(std::mt19937_64& g, index_t kv_heads, index_t n, index_t d, index_t dv, index_t q_heads,
                        index_t steps) {
  io::kv_dump dump;
  dump.kv_heads = kv_heads;
  dump.n = n;
  dump.d = d;
  dump.dv = dv;
  dump.q_heads = q_heads;
  dump.steps = steps;
  dump.kv = io::kv_arrays<T>{floe::testing::random_elements<T>(g, kv_heads * n * d),
                             floe::testing::random_elements<T>(g, kv_heads * n * dv)};
  dump.queries = floe::testing::random_floats(g, q_heads * steps * d);
  dump.scale = 0.3f;
  dump.meta = io::json(io::json::object{{"model", "test"}, {"layer", 3}});
  return dump;
}

void write_text(const std::filesystem::path& p, const std::string& text) {
  std::ofstream(p) << text;
}

// The error loading `dir` raises: argument (file) and message.
std::pair<std::string, std::string> load_error(const std::filesystem::path& dir) {
  try {
    io::load_kv_dump(dir);
  } catch (const floe::invalid_argument& e) {
    return {e.argument(), e.what()};
  }
  return {"", "no error"};
}

}  // namespace

TEMPLATE_TEST_CASE("kv_dump: save then load gives back every array, the scale and meta", "[io]", float, half,
                   bfloat16) {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(2);
  floe::testing::temp_dir dir;
  const auto dump = random_dump<TestType>(g, 3, 37, 16, 8, 6, 4);
  io::save_kv_dump(dir.path, dump);
  const auto back = io::load_kv_dump(dir.path);
  CHECK(back.kv_heads == 3);
  CHECK(back.n == 37);
  CHECK(back.d == 16);
  CHECK(back.dv == 8);
  CHECK(back.q_heads == 6);
  CHECK(back.steps == 4);
  CHECK(back.group() == 2);
  CHECK(back.scale == 0.3f);
  CHECK(back.dtype_name() == element_name<TestType>());
  CHECK(back.meta.find("model")->as_string() == "test");
  CHECK(back.queries == dump.queries);
  const auto& a = std::get<io::kv_arrays<TestType>>(dump.kv);
  const auto& b = std::get<io::kv_arrays<TestType>>(back.kv);
  REQUIRE(a.keys.size() == b.keys.size());
  for (index_t i = 0; i < a.keys.size(); ++i) REQUIRE(to_float(a.keys[i]) == to_float(b.keys[i]));
  for (index_t i = 0; i < a.values.size(); ++i) REQUIRE(to_float(a.values[i]) == to_float(b.values[i]));

  // Views and query groups address head h, step t where the format says.
  back.visit_head(2, [&](const auto& kv) {
    CHECK(kv.n() == 37);
    CHECK(to_float(kv.key_row(5)[3]) == to_float(a.keys[(2 * 37 + 5) * 16 + 3]));
    CHECK(to_float(kv.value_row(36)[7]) == to_float(a.values[(2 * 37 + 36) * 8 + 7]));
  });
  const query_group q = back.queries_of(1, 3);  // KV head 1: query heads 2 and 3
  CHECK(q.heads == 2);
  CHECK(q.row(0)[0] == dump.queries[(2 * 4 + 3) * 16]);
  CHECK(q.row(1)[5] == dump.queries[(3 * 4 + 3) * 16 + 5]);
  CHECK(q.scale == 0.3f);
}

TEST_CASE("kv_dump: without meta.json the scale is 1/sqrt(d) and float16 / float32 are taken as stored", "[io]") {
  auto g = floe::testing::rng(3);
  floe::testing::temp_dir dir;
  io::save_kv_dump(dir.path, random_dump<half>(g, 1, 10, 64, 64, 1, 1));
  std::filesystem::remove(dir / "meta.json");
  const auto back = io::load_kv_dump(dir.path);
  CHECK(back.scale == Approx(0.125f));
  CHECK(back.dtype_name() == "f16");
  CHECK(back.meta.is_object());
}

TEST_CASE("kv_dump: layers are found in numeric order, and a directory with neither is an error", "[io]") {
  auto g = floe::testing::rng(4);
  floe::testing::temp_dir dir;
  for (int layer : {15, 2, 8})
    io::save_kv_dump(dir / ("layer_" + std::string(layer < 10 ? "0" : "") + std::to_string(layer)),
                     random_dump<float>(g, 1, 4, 4, 4, 1, 1));
  std::filesystem::create_directories(dir / "layer_notes");
  const auto layers = io::kv_dump_layers(dir.path);
  REQUIRE(layers.size() == 3);
  CHECK(layers[0].filename() == "layer_02");
  CHECK(layers[1].filename() == "layer_08");
  CHECK(layers[2].filename() == "layer_15");
  CHECK(io::kv_dump_layers(layers[1]) == std::vector<std::filesystem::path>{layers[1]});
  CHECK_THROWS_WITH(io::kv_dump_layers(dir / "layer_notes"), Catch::Contains("neither keys.npy nor layer_XX"));
  CHECK_THROWS_WITH(io::kv_dump_layers(dir / "absent"), Catch::Contains("is not a directory"));
}

TEST_CASE("kv_dump: inconsistent dumps are rejected naming the file at fault", "[io]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(5);
  floe::testing::temp_dir dir;
  const auto good = random_dump<float>(g, 2, 12, 8, 6, 4, 3);
  const auto reset = [&] {
    std::filesystem::remove_all(dir.path);
    io::save_kv_dump(dir.path, good);
  };
  const auto write = [&](const char* name, std::span<const index_t> shape, auto element) {
    using T = decltype(element);
    index_t count = 1;
    for (index_t s : shape) count *= s;
    io::write_npy<T>(dir / name, std::vector<T>(count, from_float<T>(0.5f)), shape);
  };
  const auto expect = [&](const char* file, const char* message) {
    const auto [arg, what] = load_error(dir.path);
    CHECK_THAT(arg, Catch::EndsWith(file));
    CHECK_THAT(what, Catch::Contains(message));
    reset();
  };
  reset();
  REQUIRE(load_error(dir.path).second == "no error");

  SECTION("rank") {
    const index_t two[2] = {2, 12 * 8};
    write("keys.npy", two, 0.f);
    expect("keys.npy", "rank 2; expected 3, [Hkv, N, d]");
    const index_t four[4] = {4, 3, 8, 1};
    write("queries.npy", four, 0.f);
    expect("queries.npy", "rank 4; expected 3, [Hq, Q, d]");
  }
  SECTION("mismatched shapes between the arrays") {
    const index_t v_n[3] = {2, 11, 6};
    write("values.npy", v_n, 0.f);
    expect("values.npy", "has shape [2, 11, dv]; keys.npy has [2, 12, d]");
    const index_t v_h[3] = {3, 12, 6};
    write("values.npy", v_h, 0.f);
    expect("values.npy", "has shape [3, 12, dv]");
    const index_t q_d[3] = {4, 3, 9};
    write("queries.npy", q_d, 0.f);
    expect("queries.npy", "has d = 9; keys.npy has d = 8");
    const index_t q_h[3] = {3, 3, 8};
    write("queries.npy", q_h, 0.f);
    expect("queries.npy", "3 query heads, not a multiple of the 2 KV heads");
    const index_t empty[3] = {2, 0, 8};
    write("keys.npy", empty, 0.f);
    expect("keys.npy", "is empty");
  }
  SECTION("dtype") {
    const index_t v[3] = {2, 12, 6};
    write("values.npy", v, half{});
    expect("values.npy", "holds float16 but");  // meta.json says float32
    std::filesystem::remove(dir / "meta.json");
    write("values.npy", v, half{});
    expect("values.npy", "holds float16 but keys.npy holds float32");
    std::filesystem::remove(dir / "meta.json");
    const index_t k[3] = {2, 12, 8};
    write("keys.npy", k, bfloat16{});  // uint16 words without meta.json saying bfloat16
    expect("keys.npy", "16-bit integer words");
    write_text(dir / "meta.json", R"({"dtype": "float16"})");
    expect("keys.npy", "holds float32 but");
    write_text(dir / "meta.json", R"({"dtype": "int8"})");
    expect("meta.json", "\"dtype\" is \"int8\"");
  }
  SECTION("truncated and missing files") {
    const auto bytes = io::make_npy(io::npy_dtype::f32, std::array<index_t, 3>{2, 12, 8},
                                    std::vector<float>(2 * 12 * 8).data());
    io::write_file(dir / "keys.npy", std::span(bytes).first(bytes.size() - 4));
    expect("keys.npy", "truncated data");
    std::filesystem::remove(dir / "values.npy");
    expect("values.npy", "cannot open");
  }
  SECTION("non-finite elements and bad meta.json") {
    const index_t k[3] = {2, 12, 8};
    std::vector<float> keys(2 * 12 * 8, 1.f);
    keys[17] = std::numeric_limits<float>::quiet_NaN();
    io::write_npy<float>(dir / "keys.npy", keys, k);
    expect("keys.npy", "element 17 is NaN or Inf");
    write_text(dir / "meta.json", "{\"scale\": -1}");
    expect("meta.json", "\"scale\" must be a finite positive number");
    write_text(dir / "meta.json", "{\"scale\": ");
    expect("meta.json", "invalid JSON");
    write_text(dir / "meta.json", "[1, 2]");
    expect("meta.json", "must hold a JSON object");
  }
}

TEST_CASE("kv_dump: bfloat16 dumps carry \"dtype\": \"bfloat16\" and float32 queries", "[io]") {
  auto g = floe::testing::rng(6);
  floe::testing::temp_dir dir;
  io::save_kv_dump(dir.path, random_dump<bfloat16>(g, 1, 5, 4, 4, 2, 2));
  CHECK(io::read_npy(dir / "keys.npy").dtype == io::npy_dtype::word16);
  CHECK(io::read_npy(dir / "queries.npy").dtype == io::npy_dtype::f32);
  std::ifstream meta(dir / "meta.json");
  const std::string text((std::istreambuf_iterator<char>(meta)), std::istreambuf_iterator<char>());
  CHECK_THAT(text, Catch::Contains("\"dtype\": \"bfloat16\""));
  CHECK(io::load_kv_dump(dir.path).dtype_name() == "bf16");
}
