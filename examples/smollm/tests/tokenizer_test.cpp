// The byte-level BPE tokenizer on a small vocabulary the test builds itself.
#include <catch2/catch.hpp>

#include <random>

#include "gguf_builder.hpp"
#include "support/random_kv.hpp"
#include "tokenizer.hpp"

using smollm::bpe_tokenizer;

namespace {

// GPT-2's byte -> character map, written out from its definition: printable Latin-1
// bytes are themselves, the other bytes take U+0100.. in order.
std::string byte_char(int b) {
  int next = 256, code = -1;
  for (int x = 0; x < 256; ++x) {
    const bool printable = (x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255);
    const int c = printable ? x : next++;
    if (x == b) code = c;
  }
  std::string s;
  if (code < 0x80) s += static_cast<char>(code);
  else s += static_cast<char>(0xC0 | (code >> 6)), s += static_cast<char>(0x80 | (code & 0x3F));
  return s;
}

struct small_vocab {
  std::vector<std::string> tokens;
  std::vector<std::string> merges;
  std::vector<std::int64_t> types;

  explicit small_vocab(std::vector<std::string> merge_list) : merges(std::move(merge_list)) {
    tokens.push_back("<|special|>");
    types.push_back(3);
    for (int b = 0; b < 256; ++b) tokens.push_back(byte_char(b)), types.push_back(1);
    for (const auto& m : merges) {
      const auto sp = m.find(' ');
      tokens.push_back(m.substr(0, sp) + m.substr(sp + 1));
      types.push_back(1);
    }
  }
  bpe_tokenizer make() const { return bpe_tokenizer(tokens, merges, types); }
  int id(const std::string& t) const {
    for (std::size_t i = 0; i < tokens.size(); ++i)
      if (tokens[i] == t) return static_cast<int>(i);
    FAIL("no token '" << t << "'");
    return -1;
  }
};

const std::string G = byte_char(' ');   // "Ġ"
const std::string C = byte_char('\n');  // "Ċ"

}  // namespace

TEST_CASE("tokenizer: merges apply by rank, lowest first", "[smollm][tokenizer]") {
  INFO("seed " << floe::testing::seed());
  const small_vocab ab_first({"a b", "b c"}), bc_first({"b c", "a b"});
  CHECK(ab_first.make().encode("abc") == std::vector<int>{ab_first.id("ab"), ab_first.id("c")});
  CHECK(bc_first.make().encode("abc") == std::vector<int>{bc_first.id("a"), bc_first.id("bc")});
  const small_vocab chain({"h e", "l l", "he ll", "hell o"});
  CHECK(chain.make().encode("hello") == std::vector<int>{chain.id("hello")});
  // Equal pairs merge leftmost first.
  const small_vocab aa({"a a"});
  CHECK(aa.make().encode("aaa") == std::vector<int>{aa.id("aa"), aa.id("a")});
}

TEST_CASE("tokenizer: the pre-tokenizer keeps merges inside GPT-2 pieces and digits alone", "[smollm][tokenizer]") {
  INFO("seed " << floe::testing::seed());
  // Every merge here would cross a piece boundary if the split were wrong.
  const small_vocab v({G + " w", G + "w o", "1 2", "c 1", "n '", "' t", G + " " + G, C + " " + C, "a " + G, ". " + G});
  const auto tok = v.make();
  CHECK(tok.encode(" wo") == std::vector<int>{v.id(G + "wo")});
  CHECK(tok.encode("c12") == std::vector<int>{v.id("c"), v.id("1"), v.id("2")});
  CHECK(tok.encode("don't") == std::vector<int>{v.id("d"), v.id("o"), v.id("n"), v.id("'t")});
  // "a  w": the last space joins the word, the one before stands alone.
  CHECK(tok.encode("a  wo") == std::vector<int>{v.id("a"), v.id(G), v.id(G + "wo")});
  CHECK(tok.encode("a   wo") == std::vector<int>{v.id("a"), v.id(G + G), v.id(G + "wo")});
  // Newlines before a word split one by one; at the end of the text they stay together.
  CHECK(tok.encode("a\n\nb") == std::vector<int>{v.id("a"), v.id(C), v.id(C), v.id("b")});
  CHECK(tok.encode("a\n\n") == std::vector<int>{v.id("a"), v.id(C + C)});
  CHECK(tok.encode(". wo") == std::vector<int>{v.id("."), v.id(G + "wo")});
  CHECK(tok.encode("").empty());
}

TEST_CASE("tokenizer: special tokens are matched literally", "[smollm][tokenizer]") {
  INFO("seed " << floe::testing::seed());
  const small_vocab v({"a b"});
  CHECK(v.make().encode("ab<|special|>ab") == std::vector<int>{v.id("ab"), 0, v.id("ab")});
  CHECK(v.make().decode(0) == "<|special|>");
}

TEST_CASE("tokenizer: decode(encode(s)) == s for random bytes, valid UTF-8 or not", "[smollm][tokenizer]") {
  INFO("seed " << floe::testing::seed());
  auto g = floe::testing::rng(20);
  const small_vocab v({G + " t", "h e", G + "t he", "e r", "1 0", byte_char(0xC3) + " " + byte_char(0xA9)});
  const auto tok = v.make();
  std::uniform_int_distribution<int> byte(0, 255), len(0, 40), kind(0, 2);
  const std::string words[] = {" the", "here", " 10", "é", "\n\n", "  ", "don't", "'re"};
  for (int trial = 0; trial < 300; ++trial) {
    std::string s;
    for (int i = len(g); i > 0; --i) {
      if (kind(g) == 0) s += static_cast<char>(byte(g));
      else s += words[static_cast<std::size_t>(byte(g)) % 8];
    }
    INFO("trial " << trial);
    CHECK(tok.decode(tok.encode(s)) == s);
  }
}

TEST_CASE("tokenizer: built from GGUF metadata, with clear errors for bad vocabularies", "[smollm][tokenizer]") {
  INFO("seed " << floe::testing::seed());
  const small_vocab v({"a b"});
  std::vector<std::int32_t> types(v.types.begin(), v.types.end());
  smollm::testing::gguf_builder b;
  b.string("tokenizer.ggml.model", "gpt2").strings("tokenizer.ggml.tokens", v.tokens)
      .strings("tokenizer.ggml.merges", v.merges).ints("tokenizer.ggml.token_type", types);
  const auto tok = bpe_tokenizer::from_gguf(smollm::gguf_file::parse(b.bytes()));
  CHECK(tok.vocab_size() == v.tokens.size());
  CHECK(tok.encode("abab") == std::vector<int>{v.id("ab"), v.id("ab")});

  smollm::testing::gguf_builder spm;
  spm.string("tokenizer.ggml.model", "llama");
  CHECK_THROWS_AS(bpe_tokenizer::from_gguf(smollm::gguf_file::parse(spm.bytes())), floe::invalid_argument);

  CHECK_THROWS_AS(bpe_tokenizer(v.tokens, {"a zz"}, {}), floe::invalid_argument);   // merge of an unknown token
  CHECK_THROWS_AS(bpe_tokenizer(v.tokens, {"ab"}, {}), floe::invalid_argument);     // not a pair
  CHECK_THROWS_AS(bpe_tokenizer(v.tokens, {}, {1, 2}), floe::invalid_argument);     // types of the wrong length
  CHECK_THROWS_AS(tok.token(-1), floe::invalid_argument);

  // A byte without a token: an error, unless there is an unknown token to stand for it.
  std::vector<std::string> no_x = v.tokens;
  no_x[1 + 'x'] = "<unused>";
  CHECK_THROWS_AS(bpe_tokenizer(no_x, {}, {}).encode("x"), floe::invalid_argument);
  CHECK(bpe_tokenizer(no_x, {}, {}, 0).encode("axa") == std::vector<int>{v.id("a"), 0, v.id("a")});
}
