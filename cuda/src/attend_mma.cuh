// The exact part and the group's scores on tensor cores, for 16-bit rows of d = dv = D
// (64 or 128), 16-byte aligned: included by attend_kernels.cu inside its anonymous
// namespace, after the helpers it shares (run_cursor, find_nonfinite, the cp.async
// wrappers). docs/cuda-executor.md, "Tensor cores".
//
// Each warp folds 16 tokens of a 64-token tile as mma.sync m16n8k16 with fp32
// accumulation, the group's heads (up to 8) as the n = 8 columns: S^T = K Q^T (keys as
// rows of A) and O^T += V^T P^T (values as rows of A, through ldmatrix.trans), so every
// row of every mma is real (heads as rows of A would leave 8 of its 16 rows zero, and
// take twice the mmas and accumulators). P^T's B fragments come from S^T's accumulators
// by movmatrix. Q and P are fp32: each is split into 16-bit terms whose sum keeps 22
// (fp16: two terms) or 24 (bf16: three) of its bits, one mma per term, so the result
// keeps fp32's precision. Q is scaled per head by a power of two into fp16's range; P by
// 2^14, so that small weights stay out of fp16's subnormals.

// Rows of a tile in shared memory are D + 8 elements apart: 8 rows read by ldmatrix hit
// 8 different 16-byte bank groups.
template <int D>
constexpr int mma_row = D + 8;
constexpr int mma_tile = 64;  // tokens per tile: 16 per warp
// Tiles in flight per block, the one folded included: 3 stages (104 KiB at d 128) and two
// blocks a multiprocessor beat 2 stages and three blocks, and issuing the next tile before
// the fold instead of after it gained nothing (H200 A/B, docs/cuda-executor.md).
constexpr int mma_stages = 3;
constexpr float p_scale = 16384.f;

template <class T>
struct mma_terms;
template <>
struct mma_terms<__half> {
  static constexpr int count = 2;
  // (x, y) as terms of packed fp16 pairs, x in the low half (the lower column).
  __device__ static void split(float x, float y, unsigned (&out)[count]) {
    const __half2 hi = __floats2half2_rn(x, y);
    const float2 back = __half22float2(hi);
    const __half2 lo = __floats2half2_rn(x - back.x, y - back.y);
    out[0] = *reinterpret_cast<const unsigned*>(&hi);
    out[1] = *reinterpret_cast<const unsigned*>(&lo);
  }
  __device__ static void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
template <>
struct mma_terms<__nv_bfloat16> {
  static constexpr int count = 3;
  __device__ static void split(float x, float y, unsigned (&out)[count]) {
#pragma unroll
    for (int i = 0; i < count; ++i) {
      const __nv_bfloat162 t = __floats2bfloat162_rn(x, y);
      const float2 back = __bfloat1622float2(t);
      x -= back.x, y -= back.y;
      out[i] = *reinterpret_cast<const unsigned*>(&t);
    }
  }
  __device__ static void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <bool Trans>
__device__ void ldmatrix_x4(unsigned (&r)[4], const void* row) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if constexpr (Trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// An 8x8 matrix of 16-bit pairs transposed across the warp (lane (g, t) holds row g,
// columns 2t and 2t + 1, before and after).
__device__ unsigned transpose8x8(unsigned x) {
  unsigned y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// Copies 64-row tiles of a chunk's tokens [first, end) (keys, and values when Values)
// into the stages, cp.async. D / 8 consecutive threads per row, one 16-byte piece each,
// so that a warp's copy reads whole rows (an earlier two-threads-a-token layout read 16
// rows a request and held the L2 at 87 % for 53 % of DRAM bandwidth). A warp copies 16
// rows a tile: lanes 0..15 find one row each (one run or block-table lookup, all in
// parallel) and leave its addresses in shared memory for the copying passes. Value rows
// past `end` are zero (a zero weight times stale bits could be NaN); key rows past it
// are left as they are (their scores are masked).
template <class T, int D, bool Values>
struct tile_copier {
  static constexpr int per_row = D / 8, rows_per_pass = block_threads / per_row, warp_rows = 32 / per_row;
  static constexpr int stage_elems = mma_tile * (Values ? 2 : 1) * mma_row<D>;
  static constexpr std::size_t tiles_bytes = std::size_t(mma_stages) * stage_elems * sizeof(T);
  static constexpr std::size_t smem_bytes = tiles_bytes + block_threads / 32 * 16 * 2 * sizeof(void*);

  run_cursor cursor;
  std::int64_t key_stride, value_stride;
  int first, end, lane, warp;
  T* tiles;
  const T** where;  // this warp's 16 (key, value) addresses

  __device__ tile_copier(const run* runs, const chunk& c, const group_desc& g, int first_, int end_, unsigned char* smem)
      : cursor{runs + c.first_run}, key_stride(g.key_stride), value_stride(g.value_stride), first(first_), end(end_),
        lane(threadIdx.x % 32), warp(threadIdx.x / 32), tiles(reinterpret_cast<T*>(smem)),
        where(reinterpret_cast<const T**>(smem + tiles_bytes) + warp * 32) {}
  __device__ int row_of(int pass, int sub) const { return pass * rows_per_pass + warp * warp_rows + sub; }
  __device__ T* stage(int t) const { return tiles + (t % mma_stages) * stage_elems; }
  __device__ void issue(int t) {
    if (lane < 16) {
      const int j = first + t * mma_tile + row_of(lane / warp_rows, lane % warp_rows);
      const T* key = nullptr;
      const T* value = nullptr;
      if (j < end) {
        cursor.seek(j);
        const std::int64_t i = cursor.row(j);
        key = static_cast<const T*>(cursor.r->keys) + i * key_stride;
        if constexpr (Values) value = static_cast<const T*>(cursor.r->values) + i * value_stride;
      }
      where[2 * lane] = key, where[2 * lane + 1] = value;
    }
    __syncwarp();
    const int piece = lane % per_row;
#pragma unroll
    for (int pass = 0; pass < 16 / warp_rows; ++pass) {
      const int sub = lane / per_row, at = pass * warp_rows + sub;
      T* key_dst = stage(t) + row_of(pass, sub) * mma_row<D> + piece * 8;
      T* value_dst = key_dst + mma_tile * mma_row<D>;
      const T* key = where[2 * at];
      if (key == nullptr) {
        if constexpr (Values) *reinterpret_cast<uint4*>(value_dst) = make_uint4(0, 0, 0, 0);
        continue;
      }
      copy16_async(key_dst, key + piece * 8);
      if constexpr (Values) copy16_async(value_dst, where[2 * at + 1] + piece * 8);
    }
    __syncwarp();  // the addresses are read before the next tile's lookup overwrites them
  }
};

// Head gr's query times `factor` as B fragments of S^T = K Q^T: dimensions 16 ks + 2 t4
// (+1) and 16 ks + 8 + 2 t4 (+1), scaled by 2^-e into fp16's range, split into terms;
// up[i]: 2^e of head 2 t4 + i (held by lane 8 t4 + 4 i), to scale the scores back.
template <class T, int D>
__device__ void query_terms(const group_desc& g, float factor, unsigned (&qb)[D / 16][2][mma_terms<T>::count],
                            float (&up)[2]) {
  const int lane = threadIdx.x % 32, gr = lane / 4, t4 = lane % 4;
  const bool real = gr < g.heads;
  float qv[D / 16][4];
  float biggest = 0.f;
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int col = 16 * ks + (i / 2) * 8 + 2 * t4 + i % 2;
      qv[ks][i] = real ? g.q[gr * g.q_stride + col] * factor : 0.f;
      biggest = fmaxf(biggest, fabsf(qv[ks][i]));
    }
  biggest = fmaxf(biggest, __shfl_xor_sync(0xffffffffu, biggest, 1));
  biggest = fmaxf(biggest, __shfl_xor_sync(0xffffffffu, biggest, 2));
  const int e = biggest == 0.f ? 0 : max(-100, min(100, int((__float_as_uint(biggest) >> 23) & 0xff) - 127 - 14));
  const float down = exp2f(float(-e));
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks)
#pragma unroll
    for (int half = 0; half < 2; ++half)
      mma_terms<T>::split(qv[ks][2 * half] * down, qv[ks][2 * half + 1] * down, qb[ks][half]);
#pragma unroll
  for (int i = 0; i < 2; ++i) up[i] = exp2f(float(__shfl_sync(0xffffffffu, e, 4 * (2 * t4 + i))));
}

// S^T of this warp's 16 tokens of a tile (keys at `keys`, rows mma_row<D> apart), before
// the scale back: tokens gr (0, 1) and gr + 8 (2, 3), heads 2 t4 (0, 2) and 2 t4 + 1 (1, 3).
template <class T, int D>
__device__ void tile_scores(const T* keys, const unsigned (&qb)[D / 16][2][mma_terms<T>::count], float (&out)[4]) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, mi = lane / 8;
  // ldmatrix addresses: lane l gives row l % 8 of matrix l / 8.
  const T* row = keys + (warp * 16 + (mi % 2) * 8 + lane % 8) * mma_row<D> + (mi / 2) * 8;
  float s[2][4] = {};  // two chains (even and odd ks), summed after
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    unsigned ka[4];
    ldmatrix_x4<false>(ka, row + 16 * ks);
#pragma unroll
    for (int n = 0; n < mma_terms<T>::count; ++n) mma_terms<T>::mma(s[ks % 2], ka, qb[ks][0][n], qb[ks][1][n]);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) out[i] = s[0][i] + s[1][i];
}

// A chunk's partial (as attend_chunks_async writes it) on tensor cores. Lane (g, t) =
// (lane / 4, lane % 4) holds head g's query (B of S^T), and scores, weights and outputs of
// heads 2t and 2t + 1.
template <class T, int D, int HP>
__global__ void __launch_bounds__(block_threads) attend_chunks_mma(const run* runs, const chunk* chunks, int chunk_count,
                                                                   unsigned long long* check, const group_desc* groups,
                                                                   int dv_max, float* work) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using terms = mma_terms<T>;
  constexpr int NT = terms::count, KS = D / 16, R = mma_row<D>;
  extern __shared__ __align__(16) unsigned char smem[];
  if (int(blockIdx.x) >= chunk_count) return find_nonfinite(groups, blockIdx.x - chunk_count, check);
  const chunk c = chunks[blockIdx.x];
  const group_desc g = groups[c.group];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, gr = lane / 4, t4 = lane % 4;
  const int tiles = (c.tokens + mma_tile - 1) / mma_tile;

  tile_copier<T, D, true> copier(runs, c, g, 0, c.tokens, smem);
#pragma unroll
  for (int t = 0; t < mma_stages - 1; ++t) {
    if (t < tiles) copier.issue(t);
    commit_async();
  }

  unsigned qb[KS][2][NT];  // head gr's query, scale and log2 e folded in
  float up[2];
  query_terms<T, D>(g, g.scale * log2e, qb, up);

  float o[D / 16][4];  // dimensions 16 jj + gr (0, 1) and + 8 (2, 3), of heads 2 t4 and 2 t4 + 1
#pragma unroll
  for (int j = 0; j < D / 16; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  // Heads 2 t4 and 2 t4 + 1: running maximum (base 2), this lane's share of the sum.
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  // ldmatrix.trans addresses of V: lane l gives row l % 8 of matrix l / 8.
  const int mi = lane / 8;
  const int value_row = warp * 16 + (mi / 2) * 8 + lane % 8, value_col = (mi % 2) * 8;

  for (int t = 0; t < tiles; ++t) {
    wait_async<mma_stages - 2>();
    __syncthreads();
    const T* keys = copier.stage(t);
    const T* values = keys + mma_tile * R;
    float s[4];
    tile_scores<T, D>(keys, qb, s);
    // Scores of tokens gr (0, 1) and gr + 8 (2, 3) of this warp's 16, heads 2 t4 (0, 2) and
    // 2 t4 + 1 (1, 3); past the chunk: -inf.
    const int first = t * mma_tile + warp * 16 + gr;
    float z[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) z[i] = first + (i / 2) * 8 < c.tokens ? s[i] * up[i % 2] : -INFINITY;
    float p[4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float top = fmaxf(z[h], z[2 + h]);
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 4));
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 8));
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 16));
      const float next = fmaxf(m[h], top);
      const float r = next == m[h] ? 1.f : exp2f(m[h] - next);  // m = -inf, next finite: 0
      p[h] = next == -INFINITY ? 0.f : exp2f(z[h] - next);
      p[2 + h] = next == -INFINITY ? 0.f : exp2f(z[2 + h] - next);
      l[h] = l[h] * r + (p[h] + p[2 + h]);
      m[h] = next;
      if (__any_sync(0xffffffffu, r != 1.f)) {
#pragma unroll
        for (int j = 0; j < D / 16; ++j) o[j][h] *= r, o[j][2 + h] *= r;
      }
    }
    // P^T's B fragments: head gr's weights of tokens 2 t4 (+1), then 8 + 2 t4 (+1).
    unsigned pt[2][NT], pb[2][NT];
    terms::split(p[0] * p_scale, p[1] * p_scale, pt[0]);
    terms::split(p[2] * p_scale, p[3] * p_scale, pt[1]);
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int n = 0; n < NT; ++n) pb[half][n] = transpose8x8(pt[half][n]);
#pragma unroll
    for (int jj = 0; jj < D / 16; ++jj) {
      unsigned va[4];
      ldmatrix_x4<true>(va, values + value_row * R + 16 * jj + value_col);
#pragma unroll
      for (int n = 0; n < NT; ++n) terms::mma(o[jj], va, pb[0][n], pb[1][n]);
    }
    if (t + mma_stages - 1 < tiles) copier.issue(t + mma_stages - 1);  // into the stage folded one step ago
    commit_async();
  }
  wait_async<0>();
  __syncthreads();  // every fold is done before the tiles' memory holds the merge

  // The four warps' states merged through shared memory (merge_states).
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 4);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 8);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 16);
  }
  float* sm_m = reinterpret_cast<float*>(smem);
  float* sm_l = sm_m + 4 * HP;
  float* sm_o = sm_l + 4 * HP;  // [warp][head][D]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int head = 2 * t4 + h;
    if (head >= HP) continue;
    if (gr == 0) sm_m[warp * HP + head] = m[h], sm_l[warp * HP + head] = l[h];
#pragma unroll
    for (int j = 0; j < D / 16; ++j) {
      sm_o[(warp * HP + head) * D + 16 * j + gr] = o[j][h];
      sm_o[(warp * HP + head) * D + 16 * j + 8 + gr] = o[j][2 + h];
    }
  }
  __syncthreads();
  merge_states<HP>(g.heads, D, 4, sm_m, sm_l, sm_o, D, 1.f / p_scale, dv_max,
                   work + static_cast<std::int64_t>(blockIdx.x) * HP * (2 + dv_max));
#else
  __trap();  // launched only on compute capability 8.0 and newer (mma_fits)
#endif
}

// Scores on tensor cores, as score_chunks writes them: scale * q_h . k for every head of
// the group (up to 8) and token of a slice of the chunk (block y of gridDim.y takes one).
// Keys only, through the same stages; the same S^T tiles as attend_chunks_mma.
template <class T, int D>
__global__ void __launch_bounds__(block_threads) score_chunks_mma(const run* runs, const chunk* chunks, int chunk_count,
                                                                  unsigned long long* check, const group_desc* groups,
                                                                  float* z, unsigned long long* bad_key) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  extern __shared__ __align__(16) unsigned char smem[];
  if (int(blockIdx.x) >= chunk_count) {
    if (blockIdx.y == 0) find_nonfinite(groups, blockIdx.x - chunk_count, check);
    return;
  }
  const chunk c = chunks[blockIdx.x];
  const group_desc g = groups[c.group];
  const int slice = (c.tokens + mma_tile * int(gridDim.y) - 1) / (mma_tile * int(gridDim.y)) * mma_tile;
  const int begin = int(blockIdx.y) * slice, end = min(c.tokens, begin + slice);
  if (begin >= end) return;  // the whole block: no barrier is reached
  const int tiles = (end - begin + mma_tile - 1) / mma_tile;
  tile_copier<T, D, false> copier(runs, c, g, begin, end, smem);
#pragma unroll
  for (int t = 0; t < mma_stages - 1; ++t) {
    if (t < tiles) copier.issue(t);
    commit_async();
  }
  unsigned qb[D / 16][2][mma_terms<T>::count];
  float up[2];
  query_terms<T, D>(g, g.scale, qb, up);
  float* base = g.out ? g.out : z;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, gr = lane / 4, t4 = lane % 4;
  for (int t = 0; t < tiles; ++t) {
    wait_async<mma_stages - 2>();
    __syncthreads();
    float s[4];
    tile_scores<T, D>(copier.stage(t), qb, s);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int j = begin + t * mma_tile + warp * 16 + gr + (i / 2) * 8, h = 2 * t4 + i % 2;
      if (j >= end || h >= g.heads) continue;
      const float score = s[i] * up[i % 2];
      base[h * g.out_stride + c.first_token + j] = score;
      if (!(score < INFINITY) && bad_key)  // NaN or +Inf: no order to rank by
        atomicMin(bad_key, static_cast<unsigned long long>(c.group) << 40 | static_cast<unsigned long long>(c.first_token + j));
    }
    if (t + mma_stages - 1 < tiles) copier.issue(t + mma_stages - 1);  // into the stage scored one step ago
    commit_async();
  }
  wait_async<0>();
#else
  __trap();  // launched only on compute capability 8.0 and newer (mma_fits)
#endif
}
