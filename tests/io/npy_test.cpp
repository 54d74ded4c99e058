// The .npy reader and writer: round trips in every element type, and a clear error
// naming the file for every kind of malformed file.
#include <catch2/catch.hpp>

#include <cstring>
#include <string>
#include <vector>

#include "floe/io/npy.hpp"
#include "support/random_kv.hpp"
#include "temp_dir.hpp"

using namespace floe;
using floe::io::npy_dtype;

namespace {

// A hand-written .npy image: version 1.0 with `header` (padded and newline-terminated)
// followed by `data_bytes` bytes.
std::vector<unsigned char> image(const std::string& header, std::size_t data_bytes, unsigned char major = 1) {
  std::string h = header;
  const std::size_t prefix = major == 1 ? 10 : 12;
  while ((prefix + h.size() + 1) % 64) h += ' ';
  h += '\n';
  std::vector<unsigned char> out = {0x93, 'N', 'U', 'M', 'P', 'Y', major, 0};
  for (std::size_t b = 0; b < prefix - 8; ++b) out.push_back(static_cast<unsigned char>((h.size() >> (8 * b)) & 0xff));
  out.insert(out.end(), h.begin(), h.end());
  out.resize(out.size() + data_bytes, 0);
  return out;
}

std::string error_of(const std::vector<unsigned char>& bytes) {
  try {
    io::parse_npy(bytes, "x.npy");
  } catch (const floe::invalid_argument& e) {
    CHECK(e.argument() == "x.npy");
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST_CASE("npy: write then read returns the same elements, shape and dtype", "[io]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(1);
  floe::testing::temp_dir dir;
  const index_t shape[3] = {2, 5, 7};
  const auto f = floe::testing::random_elements<float>(g, 70);
  const auto h = floe::testing::random_elements<half>(g, 70);
  const auto b = floe::testing::random_elements<bfloat16>(g, 70);
  io::write_npy<float>(dir / "f.npy", f, shape);
  io::write_npy<half>(dir / "h.npy", h, shape);
  io::write_npy<bfloat16>(dir / "b.npy", b, shape);

  const auto rf = io::read_npy(dir / "f.npy");
  CHECK(rf.dtype == npy_dtype::f32);
  CHECK(rf.shape == std::vector<index_t>{2, 5, 7});
  REQUIRE(rf.data.size() == 70 * 4);
  CHECK(std::memcmp(rf.data.data(), f.data(), 280) == 0);
  const auto rh = io::read_npy(dir / "h.npy");
  CHECK(rh.dtype == npy_dtype::f16);
  CHECK(std::memcmp(rh.data.data(), h.data(), 140) == 0);
  const auto rb = io::read_npy(dir / "b.npy");
  CHECK(rb.dtype == npy_dtype::word16);  // bfloat16 travels as uint16
  CHECK(std::memcmp(rb.data.data(), b.data(), 140) == 0);
}

TEST_CASE("npy: headers are 64-byte aligned and NumPy-readable in form", "[io]") {
  const float x[3] = {1, 2, 3};
  const index_t shape[1] = {3};
  const auto bytes = io::make_npy(npy_dtype::f32, shape, x);
  const std::size_t header_len = bytes[8] | (bytes[9] << 8);
  CHECK((10 + header_len) % 64 == 0);
  const std::string header(bytes.begin() + 10, bytes.begin() + 10 + static_cast<long>(header_len));
  CHECK(header.find("'descr': '<f4'") != std::string::npos);
  CHECK(header.find("'shape': (3,)") != std::string::npos);
  CHECK(header.back() == '\n');
  CHECK(io::parse_npy(bytes, "x.npy").shape == std::vector<index_t>{3});
}

TEST_CASE("npy: versions 2.0 and 3.0 headers are read", "[io]") {
  for (unsigned char major : {2, 3}) {
    const auto a = io::parse_npy(image("{'descr': '<f2', 'fortran_order': False, 'shape': (4, 2), }", 16, major), "x.npy");
    CHECK(a.dtype == npy_dtype::f16);
    CHECK(a.shape == std::vector<index_t>{4, 2});
  }
}

TEST_CASE("npy: every malformed file is rejected with a message naming the fault", "[io]") {
  const std::string ok = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  REQUIRE(error_of(image(ok, 24)) == "no error");

  auto bad_magic = image(ok, 24);
  bad_magic[1] = 'X';
  CHECK_THAT(error_of(bad_magic), Catch::Contains("not a .npy file"));
  CHECK_THAT(error_of({0x93, 'N', 'U'}), Catch::Contains("not a .npy file"));
  CHECK_THAT(error_of(image(ok, 24, 9)), Catch::Contains("version 9"));

  auto cut_header = image(ok, 0);
  cut_header.resize(30);
  CHECK_THAT(error_of(cut_header), Catch::Contains("truncated header"));

  CHECK_THAT(error_of(image("['descr', '<f4']", 24)), Catch::Contains("not a Python dict"));
  CHECK_THAT(error_of(image("{'fortran_order': False, 'shape': (2, 3), }", 24)), Catch::Contains("no 'descr'"));
  CHECK_THAT(error_of(image("{'descr': '<f4', 'shape': (2, 3), }", 24)), Catch::Contains("no 'fortran_order'"));
  CHECK_THAT(error_of(image("{'descr': '<f4', 'fortran_order': False, }", 24)), Catch::Contains("no 'shape'"));

  // dtype
  CHECK_THAT(error_of(image("{'descr': '<f8', 'fortran_order': False, 'shape': (2, 3), }", 48)),
             Catch::Contains("unsupported dtype '<f8'"));
  CHECK_THAT(error_of(image("{'descr': '<i4', 'fortran_order': False, 'shape': (2, 3), }", 24)),
             Catch::Contains("unsupported dtype '<i4'"));
  CHECK_THAT(error_of(image("{'descr': '>f4', 'fortran_order': False, 'shape': (2, 3), }", 24)),
             Catch::Contains("big-endian"));
  CHECK_THAT(error_of(image("{'descr': 5, 'fortran_order': False, 'shape': (2, 3), }", 24)),
             Catch::Contains("'descr' is not a string"));

  // layout and shape
  CHECK_THAT(error_of(image("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", 24)),
             Catch::Contains("Fortran order"));
  CHECK_THAT(error_of(image("{'descr': '<f4', 'fortran_order': False, 'shape': [2, 3], }", 24)),
             Catch::Contains("not a tuple"));
  CHECK_THAT(error_of(image("{'descr': '<f4', 'fortran_order': False, 'shape': (2, -3), }", 24)),
             Catch::Contains("not a count"));
  CHECK_THAT(error_of(image("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3", 24)),
             Catch::Contains("not a Python dict"));

  // data length
  CHECK_THAT(error_of(image(ok, 23)), Catch::Contains("truncated data: 23 bytes for 6 elements"));
  CHECK_THAT(error_of(image(ok, 25)), Catch::Contains("1 bytes after the data"));
}

TEST_CASE("npy: a missing file is an error naming it", "[io]") {
  floe::testing::temp_dir dir;
  try {
    io::read_npy(dir / "absent.npy");
    FAIL("no error");
  } catch (const floe::invalid_argument& e) {
    CHECK_THAT(e.argument(), Catch::Contains("absent.npy"));
    CHECK_THAT(e.what(), Catch::Contains("cannot open"));
  }
}

TEST_CASE("npy: write_npy rejects a shape that does not match the elements", "[io]") {
  floe::testing::temp_dir dir;
  const std::vector<float> x(6);
  const index_t shape[2] = {2, 4};
  CHECK_THROWS_AS(io::write_npy<float>(dir / "x.npy", x, shape), floe::invalid_argument);
}
