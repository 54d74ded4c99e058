// The seam between floe::exec::cuda (a host header any C++20 compiler reads) and its
// kernels (cuda/src, compiled by nvcc into floe::cuda): plain structs and launchers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace floe {

// A CUDA runtime failure (no device, out of device memory, a failed launch). Bad
// arguments are floe::invalid_argument, as everywhere else.
class cuda_error : public std::runtime_error {
 public:
  explicit cuda_error(const std::string& what) : std::runtime_error("floe: CUDA: " + what) {}
};

namespace cuda_detail {

enum class element : int { f32 = 0, f16 = 1, bf16 = 2 };

// `count` rows on the device. Strided (table null): evenly strided rows from `keys` and
// `values`. Paged: tokens first, first + 1, ... of a sequence whose token t sits in row
// table[t / block_size] * block_size + t % block_size of the pools `keys` and `values`
// (the block table is read on the device, so a run may span any number of blocks). With
// block_size 1 the table is a token list (scattered selections, decode_indexed).
struct run {
  const void* keys;
  const void* values;
  const std::int32_t* table;
  std::int32_t count, first, block_size;
};

// One thread block's work: runs [first_run, first_run + runs) of one group, holding
// `tokens` tokens, the first of which is token `first_token` of the group's selection.
struct chunk {
  std::int32_t group, first_run, runs, tokens, first_token;
};

// One GQA group (or a slice of its heads): device queries and, for decode, device output.
struct group_desc {
  const float* q;          // [heads, q_stride], device
  float* out;              // [heads, out_stride], device; null: partials go to `results`
  std::int64_t q_stride, out_stride, key_stride, value_stride;
  std::int32_t heads, d, dv, first_chunk, chunks, aligned;  // aligned: 4-element vector loads are safe
  float scale;
};

// The most query heads one pass serves, and the widest row (d or dv) the kernels take.
constexpr int max_row = 256;
inline int heads_per_pass(int row) { return row > 128 ? 4 : 8; }

int device_count();  // 0 when there is no usable device or driver
// Makes `device` current and `stream` (a cudaStream_t; null: the per-thread default
// stream) the one the calling thread's next allocations, copies and launches use.
void select_device(int device, void* stream);
void* device_alloc(std::size_t bytes);  // stream-ordered on the call's stream
void device_free(void* p);
void to_device(void* dst, const void* src, std::size_t bytes);
void to_host(void* dst, const void* src, std::size_t bytes);
void synchronize();

// A plan's chunks on the device, as every launch over them takes them: heads_pass (1, 4
// or 8) heads of a group a block; all_aligned: every group's rows allow 16-byte loads
// (the pipelined kernels run); min_row: the narrowest d or dv of any group (row the
// widest): the tensor-core kernels need them equal.
struct chunk_plan {
  element type;
  int row, heads_pass;
  const run* runs;
  const chunk* chunks;
  int chunk_count;
  const group_desc* groups;
  int group_count;
  bool all_aligned;
  int min_row;
};

// One launch of the exact part: chunk partials into `work` ([chunks, heads_pass * (2 +
// dv_max)]), then per group either out = a / l (groups with `out`) or (m, l, a) into
// results[group * heads_pass * (2 + dv_max)] (m at [h], l at [heads_pass + h], a at
// [2 * heads_pass + h * dv_max]). `check` (device, nullable, preset to ~0): the launch
// also checks every group's device queries into it (see nonfinite_query), and the merge
// writes nothing unless it still holds ~0.
struct launch_args {
  chunk_plan plan;
  int dv_max;
  float* work;
  float* results;
  unsigned long long* check;
};
void launch_attend(const launch_args& args);
int multiprocessors(int device);

// Scores of each chunk's tokens for every head of its group (up to heads_pass): scale *
// q_h . k into out[h * out_stride + first_token + j] when the group has a device `out`,
// else into z[first_token + j] (one head, out_stride 0). `check` (device, nullable,
// preset to ~0): the launch also checks every group's device queries into it, as
// launch_args::check does. `bad_key` (device, nullable, preset to ~0): receives the
// lowest group << 40 | token whose score is NaN or +Inf (a NaN or Inf in its key, or an
// overflow), which decode_bad_key unpacks. 16-bit rows of d = 64 or 128 (all_aligned,
// min_row = row) are scored on tensor cores.
struct score_launch_args {
  chunk_plan plan;
  float* z = nullptr;
  unsigned long long* check = nullptr;
  unsigned long long* bad_key = nullptr;
};
void launch_score(const score_launch_args& args);

// For each of `groups` groups g, the k heaviest (0 < k < n) of w_i = sum_h exp(z_hi -
// m_h) / l_h, each head's softmax over its n scores (z: device, [groups, heads, n]):
// their indices, ascending, into chosen + g * k (device); ties at the k-th weight go to
// the lower index. `scratch` (device) holds top_k_scratch_bytes(heads, n, groups) bytes.
// `proceed` (device, nullable, two words): nothing is written into `chosen` unless both
// hold ~0 when the last kernel runs (launch_score's query check and bad_key).
std::size_t top_k_scratch_bytes(int heads, std::int64_t n, int groups = 1);
void launch_group_top_k(const float* z, int heads, std::int64_t n, std::int64_t k, void* scratch,
                        std::int32_t* chosen, int groups = 1, const unsigned long long* proceed = nullptr);

// A device token list to check: `count` indices that must ascend strictly and lie in [0, n).
struct token_list {
  const std::int32_t* indices;
  std::int32_t count, n;
};
// Checks `lists` (device descriptors) on the device: the first bad (list, position) goes
// into `first` (device, preset to ~0) as list << 32 | position.
void launch_check_tokens(const token_list* lists, int list_count, unsigned long long* first);

// Device queries are checked on the device (launch_args::check): the flag receives the
// lowest (group, head, element) of a NaN or Inf, which decode_nonfinite unpacks (group -1:
// all finite).
struct nonfinite_query {
  std::int32_t group, head, element;
};
nonfinite_query decode_nonfinite(unsigned long long first);
// launch_score's bad_key unpacked (group -1: every score finite).
struct bad_score {
  std::int32_t group;
  std::int64_t token;
};
inline bad_score decode_bad_key(unsigned long long first) {
  if (first == ~0ull) return {-1, 0};
  return {static_cast<std::int32_t>(first >> 40), static_cast<std::int64_t>(first & ((1ull << 40) - 1))};
}

// Page-locked host memory of at least `bytes`, owned by the calling thread and reused by
// its next call (each call synchronizes before it returns): uploads from it are direct.
void* host_staging(std::size_t bytes);

}  // namespace cuda_detail
}  // namespace floe
