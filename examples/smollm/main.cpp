// floe-smollm: SmolLM2-135M (GGUF) end to end, with decode attention through floe.
// See docs/real-model.md for how to fetch the model and texts and reproduce the numbers.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "gguf.hpp"
#include "methods.hpp"
#include "model.hpp"
#include "npy_writer.hpp"
#include "run.hpp"
#include "tokenizer.hpp"

namespace {

using namespace smollm;

const char* usage =
    "usage: floe-smollm --model FILE.gguf MODE [options]\n"
    "modes:\n"
    "  --generate PROMPT     greedy generation [--max-new N=48] [--chat]\n"
    "  --perplexity FILE     prefill --ctx N tokens, teacher-force the next --eval M through decode steps,\n"
    "                        for dense and each method of --attn LIST at each --budget F,F.. (of ctx; 0.1)\n"
    "  --dump-kv DIR         --text FILE --ctx N --layers L1,L2,.. [--queries Q=32]: KV dump per layer\n"
    "  --logits FILE.npy     --text FILE --tokens T [--decode]: logits [T, vocab] (and FILE.tokens.npy)\n"
    "  --tokenize FILE       [--out IDS.npy] [--chars C]: token ids of the first C characters\n"
    "  (--perplexity, --dump-kv and --logits take --skip N: start N tokens into the text)\n"
    "  --calibrate-anchors FILE  dense decode of --eval M steps after --ctx N tokens of FILE, measuring how\n"
    "                        well each layer's top --budget F reuses across layers; writes the anchor plan\n"
    "                        of each count in --anchors C,C.. (default 4,6,10) to --out PREFIX-C.json;\n"
    "                        --dense-layers L,L.. attend everything (default 0, as Kascade; 'none')\n"
    "  --list-methods        the methods --attn takes (floe-eval's registry, anchor_reuse, mog:sample[:token_scan[2]])\n"
    "options: --attn NAME[,NAME..] (default dense)  --exec simd|scalar (floe executor, default simd)\n"
    "         --threads N (Eigen's, default 1)  --anchor-plan FILE (for --attn anchor_reuse+none,\n"
    "         anchor_reuse:same_heads+none; from --calibrate-anchors)\n";

struct options {
  std::map<std::string, std::string> values;
  bool has(const std::string& k) const { return values.count(k) != 0; }
  std::string get(const std::string& k, const std::string& fallback = "") const {
    auto it = values.find(k);
    return it == values.end() ? fallback : it->second;
  }
  std::string need(const std::string& k) const {
    floe::require(has(k), k.c_str(), "is required in this mode");
    return values.at(k);
  }
  long integer(const std::string& k, long fallback) const {
    if (!has(k)) return fallback;
    std::size_t used = 0;
    long v = 0;
    try { v = std::stol(values.at(k), &used); } catch (const std::exception&) { used = 0; }
    floe::require(used == values.at(k).size() && used > 0, k.c_str(), "'", values.at(k), "' is not an integer");
    return v;
  }
};

options parse(int argc, char** argv) {
  static const char* flags[] = {"--chat", "--decode", "--list-methods"};
  options o;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    floe::require(k.rfind("--", 0) == 0, "arguments", "unexpected '", k, "'\n", usage);
    bool flag = false;
    for (const char* f : flags) flag = flag || k == f;
    if (flag || k == "--help") {
      o.values[k] = "1";
    } else {
      floe::require(i + 1 < argc, k.c_str(), "needs a value");
      o.values[k] = argv[++i];
    }
  }
  return o;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  floe::require(in.good(), "text", "cannot open '", path, "'");
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The text's tokens, less the first --skip ones (to measure at another place in a book).
std::vector<int> text_tokens(const bpe_tokenizer& tok, const std::string& path, const options& o) {
  std::vector<int> ids = tok.encode(read_text(path));
  const auto skip = static_cast<std::size_t>(o.integer("--skip", 0));
  floe::require(skip < ids.size(), "skip", "skips ", skip, " of the text's ", ids.size(), " tokens");
  ids.erase(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(skip));
  return ids;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, sep);)
    if (!item.empty()) out.push_back(item);
  return out;
}

int run_generate(const llama_model& model, const bpe_tokenizer& tok, const options& o) {
  std::string prompt = o.need("--generate");
  if (o.has("--chat")) prompt = "<|im_start|>user\n" + prompt + "<|im_end|>\n<|im_start|>assistant\n";
  const std::vector<int> ids = tok.encode(prompt);
  const int max_new = static_cast<int>(o.integer("--max-new", 48));
  recent_queries recent;
  auto method = make_attention(split(o.get("--attn", "dense"), ',').at(0), std::stod(o.get("--budget", "0.1")),
                               o.get("--exec", "simd"), nullptr, &recent, model.config().group(), model.config().head_dim);
  kv_cache cache(model.config(), static_cast<int>(ids.size()) + max_new);
  matrix logits = prefill(model, ids, cache, false, 256, true, &recent);
  method->build(model.config(), cache);
  std::cout << o.get("--generate") << std::flush;
  floe::stats io;
  const auto t0 = std::chrono::steady_clock::now();
  const double c0 = cpu_seconds();
  int produced = 0;
  for (; produced < max_new; ++produced) {
    const int next = argmax(logits);
    const std::string piece = tok.decode(next);
    if (next == 2 || piece == "<|im_end|>" || piece == "<|endoftext|>") break;
    std::cout << piece << std::flush;
    if (produced + 1 < max_new) logits = decode_step(model, next, cache, *method, io);
  }
  const double s = seconds_since(t0), cpu = cpu_seconds() - c0;
  std::cout << std::endl;
  std::fprintf(stderr, "%d tokens in %.2f s: %.1f tokens/s, %.1f per CPU s (attention: %s)\n", produced, s,
               produced / s, produced / cpu, method->name().c_str());
  return 0;
}

// The --anchor-plan file, checked against the model's layers and KV heads.
floe::select::anchor_plan model_plan(const llama_model& model, const options& o) {
  auto plan = read_plan(o.need("--anchor-plan"));
  floe::require(plan.layers == static_cast<floe::index_t>(model.config().n_layer) &&
                    plan.kv_heads == static_cast<floe::index_t>(model.config().n_head_kv),
                "anchor-plan", "is for ", plan.layers, " layers x ", plan.kv_heads, " KV heads, the model has ",
                model.config().n_layer, " x ", model.config().n_head_kv);
  return plan;
}

// Calibrates anchor plans on a development text: --eval dense decode steps after a --ctx
// prefill, then one plan per count in --anchors, written to --out PREFIX-C.json.
int run_calibrate(const llama_model& model, const bpe_tokenizer& tok, const options& o) {
  const llama_config& c = model.config();
  const std::string path = o.need("--calibrate-anchors"), prefix = o.need("--out");
  const std::vector<int> ids = text_tokens(tok, path, o);
  const int ctx = static_cast<int>(o.integer("--ctx", 2048)), steps = static_cast<int>(o.integer("--eval", 64));
  const double fraction = std::stod(o.get("--budget", "0.05"));
  floe::require(ctx > 0 && steps > 0, "ctx", "--ctx and --eval must be positive");
  floe::require(static_cast<std::size_t>(ctx + steps) <= ids.size() && ctx + steps <= c.n_ctx_train, "eval",
                "ctx + eval = ", ctx + steps, " exceeds the text's ", ids.size(), " tokens or the model's context");
  std::vector<floe::index_t> counts;
  for (const auto& s : split(o.get("--anchors", "4,6,10"), ',')) {
    const long m = std::stol(s);
    floe::require(m >= 1 && m <= c.n_layer, "anchors", "count ", m, " is outside [1, ", c.n_layer, "]");
    counts.push_back(static_cast<floe::index_t>(m));
  }
  std::vector<floe::index_t> dense;
  for (const auto& s : split(o.get("--dense-layers", "0"), ','))
    if (s != "none") dense.push_back(static_cast<floe::index_t>(std::stoul(s)));
  floe::select::anchor_calibration cal(static_cast<floe::index_t>(c.n_layer), static_cast<floe::index_t>(c.n_head_kv),
                                       fraction);
  kv_cache cache(c, ctx + steps);
  prefill(model, std::span<const int>(ids.data(), static_cast<std::size_t>(ctx)), cache);
  calibrating_attention method(make_attention("dense", 1.0, o.get("--exec", "simd")), cal);
  method.build(c, cache);
  floe::stats io;
  for (int t = 0; t < steps; ++t) {
    decode_step(model, ids[static_cast<std::size_t>(ctx + t)], cache, method, io);
    if ((t + 1) % 8 == 0 || t + 1 == steps) std::fprintf(stderr, "\rcalibrating anchors: step %d/%d", t + 1, steps);
  }
  std::fprintf(stderr, "\n");
  const auto sim = cal.layer_similarity(true), flat = cal.layer_similarity(false);
  const floe::index_t L = static_cast<floe::index_t>(c.n_layer);
  std::printf("anchor calibration on %s: ctx %d, %d steps, top %.3g of the cache per (layer, KV head)\n",
              std::filesystem::path(path).filename().c_str(), ctx, steps, fraction);
  std::printf("%-6s %9s %13s %13s\n", "layer", "own top-k", "prev (heads)", "prev (same)");
  for (floe::index_t l = 0; l < L; ++l)
    std::printf("%-6u %9.3f %13.3f %13.3f\n", static_cast<unsigned>(l), sim[l * L + l],
                l ? sim[(l - 1) * L + l] : 1.0, l ? flat[(l - 1) * L + l] : 1.0);
  for (floe::index_t m : counts) {
    const auto plan = cal.plan(m, true, dense);
    double kept = 0;
    for (floe::index_t l = 0; l < L; ++l) kept += plan.is_dense(l) ? 1.0 : sim[plan.anchor_of[l] * L + l];
    const std::string out = prefix + "-" + std::to_string(m) + ".json";
    std::ofstream(out) << plan_json(plan, cal, fraction, std::filesystem::path(path).filename().string());
    std::printf("%u anchors (dense:", static_cast<unsigned>(m));
    for (auto l : plan.dense_layers) std::printf(" %u", static_cast<unsigned>(l));
    std::printf("):");
    for (auto a : plan.anchors()) std::printf(" %u", static_cast<unsigned>(a));
    std::printf("; mean weight kept %.3f; wrote %s\n", kept / L, out.c_str());
  }
  return 0;
}

// Teacher-forces tokens ids[ctx .. ctx+eval] through decode steps with one method, from
// the prefill cache, and prints its row of the perplexity table.
void run_method(const llama_model& model, const std::vector<int>& ids, int ctx, int eval, const kv_cache& after_prefill,
                kv_cache& cache, const std::string& name, double budget, const std::string& budget_text,
                const std::string& exec, const floe::select::anchor_plan* plan, const recent_queries& recent) {
  const auto& c = model.config();
  auto method = make_attention(name, budget, exec, plan, &recent, c.group(), c.head_dim);
  cache = after_prefill;
  method->build(model.config(), cache);
  floe::stats io;
  double nll = 0;
  const auto t1 = std::chrono::steady_clock::now();
  const double c1 = cpu_seconds();
  for (int t = 0; t < eval; ++t) {
    const matrix logits = decode_step(model, ids[static_cast<std::size_t>(ctx + t)], cache, *method, io);
    nll += negative_log_likelihood(logits, ids[static_cast<std::size_t>(ctx + t + 1)]);
    if ((t + 1) % 32 == 0 || t + 1 == eval) std::fprintf(stderr, "\r%s: decode %d/%d", name.c_str(), t + 1, eval);
  }
  std::fprintf(stderr, "\n");
  const double s = seconds_since(t1), cpu = cpu_seconds() - c1;
  const double dense_bytes = static_cast<double>(io.tokens_total) * model.config().head_dim * 2 * sizeof(float);
  std::printf("%-50s %7s %11.3f %9.4f %10.2f%% %11.2f%% %10.2f %10.2f\n", method->name().c_str(),
              budget_text.c_str(), std::exp(nll / eval), nll / eval,
              100.0 * static_cast<double>(io.tokens_read) / static_cast<double>(io.tokens_total),
              100.0 * static_cast<double>(io.bytes_read()) / dense_bytes, eval / s, eval / cpu);
  std::fflush(stdout);
}

int run_perplexity(const llama_model& model, const bpe_tokenizer& tok, const options& o) {
  const std::string path = o.need("--perplexity");
  const std::vector<int> ids = text_tokens(tok, path, o);
  const int ctx = static_cast<int>(o.integer("--ctx", 2048)), eval = static_cast<int>(o.integer("--eval", 256));
  floe::require(ctx > 0 && eval > 0, "ctx", "--ctx and --eval must be positive");
  floe::require(static_cast<std::size_t>(ctx + eval + 1) <= ids.size(), "eval", "the text has ", ids.size(),
                " tokens, ", ctx + eval + 1, " needed");
  floe::require(ctx + eval <= model.config().n_ctx_train, "ctx", "ctx + eval = ", ctx + eval,
                " exceeds the model's context of ", model.config().n_ctx_train);
  // Dense first (the reference), then every other method at every budget.
  std::vector<std::pair<std::string, double>> runs{{"dense", 1.0}};
  for (const auto& n : split(o.get("--attn", "dense"), ','))
    for (const auto& b : split(o.get("--budget", "0.1"), ','))
      if (n != "dense") runs.emplace_back(n, std::stod(b));

  std::unique_ptr<floe::select::anchor_plan> plan;
  if (o.has("--anchor-plan")) plan = std::make_unique<floe::select::anchor_plan>(model_plan(model, o));
  recent_queries recent;  // the last 32 prefill queries of every layer, for mog:sample
  for (const auto& [name, budget] : runs)
    make_attention(name, budget, o.get("--exec", "simd"), plan.get(), &recent, model.config().group(),
                   model.config().head_dim);
  kv_cache cache(model.config(), ctx + eval);
  const auto t0 = std::chrono::steady_clock::now();
  const double c0 = cpu_seconds();
  prefill(model, std::span<const int>(ids.data(), static_cast<std::size_t>(ctx)), cache, false, 256, true, &recent);
  const double prefill_s = seconds_since(t0), prefill_cpu = cpu_seconds() - c0;
  const kv_cache after_prefill = cache;

  std::printf("perplexity of %s: %zu tokens; prefill %d tokens in %.1f s, %.1f CPU s (%.0f tokens/s, %.0f per "
              "CPU s); %d teacher-forced decode steps\n",
              std::filesystem::path(path).filename().c_str(), ids.size(), ctx, prefill_s, prefill_cpu, ctx / prefill_s,
              ctx / prefill_cpu, eval);
  std::printf("%-50s %7s %11s %9s %11s %12s %10s %10s\n", "method", "budget", "perplexity", "nll", "keys read",
              "bytes read", "tokens/s", "tok/cpu-s");
  for (const auto& [name, budget] : runs) {
    const std::string budget_text = name == "dense" ? "-" : std::to_string(budget).substr(0, 5);
    try {
      run_method(model, ids, ctx, eval, after_prefill, cache, name, budget, budget_text, o.get("--exec", "simd"),
                 plan.get(), recent);
    } catch (const floe::invalid_argument& e) {
      // A method that cannot follow a growing cache through this interface (an index that
      // needs append()) is reported and skipped; the others still run.
      std::printf("%-50s %7s failed: %s\n", name.c_str(), budget_text.c_str(), e.what());
      std::fflush(stdout);
      if (name == "dense") throw;
    }
  }
  return 0;
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) out += c;
  }
  return out + "\"";
}

int run_dump(const llama_model& model, const bpe_tokenizer& tok, const options& o) {
  const llama_config& c = model.config();
  const std::string dir = o.need("--dump-kv"), text = o.need("--text");
  const std::vector<int> ids = text_tokens(tok, text, o);
  const int ctx = static_cast<int>(o.integer("--ctx", 2048)), nq = static_cast<int>(o.integer("--queries", 32));
  floe::require(ctx > 0 && nq > 0, "ctx", "--ctx and --queries must be positive");
  floe::require(static_cast<std::size_t>(ctx + nq) <= ids.size(), "ctx", "the text has ", ids.size(), " tokens, ",
                ctx + nq, " needed");
  floe::require(ctx + nq <= c.n_ctx_train, "ctx", "ctx + queries = ", ctx + nq,
                " exceeds the model's trained context of ", c.n_ctx_train);
  std::vector<int> layers;
  for (const auto& s : split(o.need("--layers"), ',')) {
    const int l = std::stoi(s);
    floe::require(l >= 0 && l < c.n_layer, "layers", "layer ", l, " is outside [0, ", c.n_layer, ")");
    layers.push_back(l);
  }

  kv_cache cache(c, ctx + nq);
  prefill(model, std::span<const int>(ids.data(), static_cast<std::size_t>(ctx)), cache);
  const std::size_t hd = static_cast<std::size_t>(c.head_dim), n = static_cast<std::size_t>(ctx);
  // queries[layer] is [Hq, Q, d]; keys and values are copied before decode appends to the cache.
  std::map<int, std::vector<float>> queries;
  for (int l : layers) {
    const auto out = std::filesystem::path(dir) / ("layer_" + std::string(l < 10 ? "0" : "") + std::to_string(l));
    std::filesystem::create_directories(out);
    std::vector<float> k, v;
    for (int g = 0; g < c.n_head_kv; ++g) {
      k.insert(k.end(), cache.key(l, g), cache.key(l, g) + n * hd);
      v.insert(v.end(), cache.value(l, g), cache.value(l, g) + n * hd);
    }
    const std::vector<std::size_t> shape{static_cast<std::size_t>(c.n_head_kv), n, hd};
    write_npy(out / "keys.npy", k.data(), shape);
    write_npy(out / "values.npy", v.data(), shape);
    queries[l].assign(static_cast<std::size_t>(c.n_head) * nq * hd, 0.f);
  }

  auto dense = make_attention("dense", 1.0, o.get("--exec", "simd"));
  dense->build(c, cache);
  floe::stats io;
  for (int t = 0; t < nq; ++t) {
    decode_step(model, ids[n + static_cast<std::size_t>(t)], cache, *dense, io, [&](int l, const matrix& q) {
      auto it = queries.find(l);
      if (it == queries.end()) return;
      for (int h = 0; h < c.n_head; ++h)
        std::copy_n(q.row(0).data() + h * hd, hd, it->second.data() + (static_cast<std::size_t>(h) * nq + t) * hd);
    });
    if ((t + 1) % 8 == 0 || t + 1 == nq) std::fprintf(stderr, "\rqueries %d/%d", t + 1, nq);
  }
  std::fprintf(stderr, "\n");
  for (int l : layers) {
    const auto out = std::filesystem::path(dir) / ("layer_" + std::string(l < 10 ? "0" : "") + std::to_string(l));
    write_npy(out / "queries.npy", queries[l].data(),
              {static_cast<std::size_t>(c.n_head), static_cast<std::size_t>(nq), hd});
    std::ofstream meta(out / "meta.json");
    meta << "{\n  \"model\": " << json_string(c.name + " (SmolLM2-135M-Instruct Q4_1 GGUF)") << ",\n"
         << "  \"layer\": " << l << ",\n  \"n_layers\": " << c.n_layer << ",\n"
         << "  \"dtype\": \"float32\",\n  \"hq\": " << c.n_head << ",\n  \"hkv\": " << c.n_head_kv
         << ",\n  \"d\": " << hd << ",\n  \"dv\": " << hd << ",\n"
         << "  \"ctx\": " << ctx << ",\n  \"queries\": " << nq << ",\n  \"query_positions\": [" << ctx << ", "
         << ctx + nq - 1 << "],\n"
         << "  \"scale\": " << 1.0 / std::sqrt(static_cast<double>(hd)) << ",\n"
         << "  \"rope\": {\"theta\": " << c.rope_base
         << ", \"layout\": \"adjacent pairs (2i, 2i+1), ggml NORM\", \"applied\": true},\n"
         << "  \"text_source\": " << json_string(std::filesystem::path(text).filename().string()) << ",\n"
         << "  \"text_skip_tokens\": " << o.integer("--skip", 0) << ",\n"
         << "  \"producer\": \"examples/smollm floe-smollm --dump-kv\"\n}\n";
  }
  std::printf("wrote %zu layers of %d tokens and %d queries to %s\n", layers.size(), ctx, nq, dir.c_str());
  return 0;
}

int run_logits(const llama_model& model, const bpe_tokenizer& tok, const options& o) {
  const std::string out = o.need("--logits");
  std::vector<int> ids = text_tokens(tok, o.need("--text"), o);
  const auto T = static_cast<std::size_t>(o.integer("--tokens", 64));
  floe::require(T > 0 && T <= ids.size(), "tokens", T, " tokens asked, the text has ", ids.size());
  ids.resize(T);
  kv_cache cache(model.config(), static_cast<int>(T));
  matrix logits;
  if (o.has("--decode")) {  // token 0 by prefill, every later one by a decode step through floe
    logits = prefill(model, std::span<const int>(ids.data(), 1), cache);
    auto dense = make_attention("dense", 1.0, o.get("--exec", "simd"));
    dense->build(model.config(), cache);
    floe::stats io;
    logits.conservativeResize(static_cast<Eigen::Index>(T), logits.cols());
    for (std::size_t t = 1; t < T; ++t)
      logits.row(static_cast<Eigen::Index>(t)) = decode_step(model, ids[t], cache, *dense, io);
  } else {
    logits = prefill(model, ids, cache, /*all_logits=*/true);
  }
  write_npy(out, logits.data(), {T, static_cast<std::size_t>(logits.cols())});
  std::vector<std::int32_t> ids32(ids.begin(), ids.end());
  write_npy(out + ".tokens.npy", ids32.data(), {T});
  std::printf("wrote logits [%zu, %ld] to %s\n", T, static_cast<long>(logits.cols()), out.c_str());
  return 0;
}

int run_tokenize(const bpe_tokenizer& tok, const options& o) {
  std::string text = read_text(o.need("--tokenize"));
  if (o.has("--chars")) text.resize(std::min(text.size(), static_cast<std::size_t>(o.integer("--chars", 0))));
  const std::vector<int> ids = tok.encode(text);
  if (o.has("--out")) {
    std::vector<std::int32_t> ids32(ids.begin(), ids.end());
    write_npy(o.get("--out"), ids32.data(), {ids32.size()});
  }
  std::printf("%zu characters, %zu tokens; round trip %s\n", text.size(), ids.size(),
              tok.decode(ids) == text ? "exact" : "DIFFERS");
  return tok.decode(ids) == text ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const options o = parse(argc, argv);
    if (o.has("--list-methods")) {
      for (const auto& m : decode_methods<floe::exec::scalar>()) std::cout << m.name << "\t" << m.description << "\n";
      std::cout << "anchor_reuse+none\tKascade: anchor layers attend their exact top k, the layers after reuse it "
                   "through the head map of --anchor-plan\n"
                << "anchor_reuse:same_heads+none\tthe same anchors, head h reusing head h (ablation of the head map)\n"
                << "mog:sample\tmog with each index built on the last 32 prefill queries of its GQA group: 3/4 of "
                   "the exact outliers are the keys those queries attend most (--perplexity, --generate)\n"
                << "mog:sample:token_scan\tmog:sample with mog:token_scan's 4-bit keys of the clustered tokens\n"
                << "mog:sample:token_scan2\tmog:sample with mog:token_scan2's 2-bit standardised codes instead\n";
      return 0;
    }
    if (o.has("--help") || argc == 1) {
      std::cout << usage;
      return 0;
    }
    // One thread unless asked: OpenMP threads spinning on a busy machine cost 10x.
    Eigen::setNbThreads(static_cast<int>(o.integer("--threads", 1)));
    const gguf_file file = gguf_file::open(o.need("--model"));
    const bpe_tokenizer tok = bpe_tokenizer::from_gguf(file);
    if (o.has("--tokenize")) return run_tokenize(tok, o);
    const auto t0 = std::chrono::steady_clock::now();
    const llama_model model(file);
    const auto& c = model.config();
    std::fprintf(stderr, "%s: %d layers, width %d, %d query / %d KV heads of %d, RoPE theta %g, loaded in %.1f s\n",
                 c.name.c_str(), c.n_layer, c.n_embd, c.n_head, c.n_head_kv, c.head_dim, c.rope_base,
                 seconds_since(t0));
    if (o.has("--generate")) return run_generate(model, tok, o);
    if (o.has("--perplexity")) return run_perplexity(model, tok, o);
    if (o.has("--dump-kv")) return run_dump(model, tok, o);
    if (o.has("--calibrate-anchors")) return run_calibrate(model, tok, o);
    if (o.has("--logits")) return run_logits(model, tok, o);
    std::cerr << usage;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "floe-smollm: " << e.what() << "\n";
    return 1;
  }
}
