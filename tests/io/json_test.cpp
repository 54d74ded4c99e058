// The meta.json reader: values, escapes, round trip through dump(), and errors.
#include <catch2/catch.hpp>

#include "floe/io/json.hpp"

using floe::io::json;

TEST_CASE("json: parses objects, arrays, strings with escapes, numbers and literals", "[io]") {
  const json v = json::parse(
      R"( {"model": "SmolLM2-135M", "layer": 8, "scale": 0.125, "rope": {"theta": 1e5, "layout": "rotate_half"},
           "layers": [2, 8, -15.5], "ok": true, "none": null, "text": "a\"b\\c\n\u00e9\ud83d\ude00"} )", "meta.json");
  REQUIRE(v.is_object());
  CHECK(v.find("model")->as_string() == "SmolLM2-135M");
  CHECK(v.find("layer")->as_number() == 8);
  CHECK(v.find("scale")->as_number() == 0.125);
  CHECK(v.find("rope")->find("theta")->as_number() == 1e5);
  CHECK(v.find("layers")->as_array().at(2).as_number() == -15.5);
  CHECK(v.find("ok")->as_bool());
  CHECK(v.find("none")->is_null());
  CHECK(v.find("text")->as_string() == "a\"b\\c\n\xc3\xa9\xf0\x9f\x98\x80");
  CHECK(v.find("absent") == nullptr);
  const json again = json::parse(v.dump(), "dump");
  CHECK(again.dump() == v.dump());
  CHECK(again.find("text")->as_string() == v.find("text")->as_string());
}

TEST_CASE("json: malformed text is rejected naming the source and the byte", "[io]") {
  for (const char* bad : {"", "{", "{\"a\" 1}", "{\"a\": }", "[1, 2", "{\"a\": 1,}", "\"open", "tru", "{} x", "01x",
                          "{\"a\": \"\\q\"}", "-", "{1: 2}"}) {
    INFO("text: " << bad);
    try {
      json::parse(bad, "meta.json");
      FAIL("no error");
    } catch (const floe::invalid_argument& e) {
      CHECK(e.argument() == "meta.json");
      CHECK_THAT(e.what(), Catch::Contains("invalid JSON at byte"));
    }
  }
}
