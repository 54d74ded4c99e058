// The exact part on tensor cores, for 16-bit rows of d = dv = D (64 or 128), 16-byte
// aligned: included by attend_kernels.cu inside its anonymous namespace, after the
// helpers it shares (run_cursor, find_nonfinite, the cp.async wrappers, stages).
// docs/cuda-executor.md, "Tensor cores".
//
// Each warp folds 16 tokens of a 64-token tile: S = Q K^T and O += P V as mma.sync
// m16n8k16 with fp32 accumulation, the group's heads as rows 0..7 of A (rows 8..15
// zero). Q and P are fp32: each is split into 16-bit terms whose sum keeps 22 (fp16: two
// terms) or 24 (bf16: three) of its bits, one mma per term, so the result keeps fp32's
// precision. Q is scaled per head by a power of two into fp16's range; P by 2^14, so that
// small weights stay out of fp16's subnormals.

// Rows of a tile in shared memory are D + 8 elements apart: 8 rows read by ldmatrix hit
// 8 different 16-byte bank groups.
template <int D>
constexpr int mma_row = D + 8;
constexpr int mma_tile = 64;  // tokens per tile: 16 per warp
constexpr float p_scale = 16384.f;

// The tiles, then per warp the key and value addresses of the 16 rows it copies.
template <int D>
constexpr std::size_t mma_tiles_bytes = std::size_t(stages) * mma_tile * 2 * mma_row<D> * 2;
template <int D>
std::size_t mma_smem_bytes() {
  return mma_tiles_bytes<D> + block_threads / 32 * 16 * 2 * sizeof(void*);
}

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
  __device__ static void mma(float (&c)[4], unsigned a0, unsigned a2, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
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
  __device__ static void mma(float (&c)[4], unsigned a0, unsigned a2, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
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

// A chunk's partial (as attend_chunks_async writes it) on tensor cores. Lane (g, t) =
// (lane / 4, lane % 4) holds head g's row of A and the accumulators of head g.
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
  constexpr int stage_elems = mma_tile * 2 * R;  // keys, then values
  T* const tile_mem = reinterpret_cast<T*>(smem);

  // Copying: D / 8 consecutive threads per row, one 16-byte piece each, so that a warp's
  // copy reads whole rows (an earlier two-threads-a-token layout read 16 rows a request
  // and held the L2 at 87 % for 53 % of DRAM bandwidth). A warp copies 16 rows a tile:
  // lanes 0..15 find one row each (one run or block-table lookup, all in parallel) and
  // leave its addresses in shared memory for the copying passes. Rows past the chunk get
  // zero values (a zero weight times stale bits could be NaN).
  constexpr int per_row = D / 8, rows_per_pass = block_threads / per_row, warp_rows = 32 / per_row;
  const int my_piece = lane % per_row;
  auto lookup_row = [&](int pass, int sub) { return pass * rows_per_pass + warp * warp_rows + sub; };
  const T** const where = reinterpret_cast<const T**>(smem + mma_tiles_bytes<D>) + warp * 32;
  run_cursor copier{runs + c.first_run};
  auto issue = [&](int t) {
    if (lane < 16) {
      const int j = t * mma_tile + lookup_row(lane / warp_rows, lane % warp_rows);
      const T* key = nullptr;
      const T* value = nullptr;
      if (j < c.tokens) {
        copier.seek(j);
        const std::int64_t i = copier.row(j);
        key = static_cast<const T*>(copier.r->keys) + i * g.key_stride;
        value = static_cast<const T*>(copier.r->values) + i * g.value_stride;
      }
      where[2 * lane] = key, where[2 * lane + 1] = value;
    }
    __syncwarp();
    T* const stage_mem = tile_mem + (t % stages) * stage_elems;
#pragma unroll
    for (int pass = 0; pass < 16 / warp_rows; ++pass) {
      const int sub = lane / per_row, at = pass * warp_rows + sub;
      T* key_dst = stage_mem + lookup_row(pass, sub) * R + my_piece * 8;
      T* value_dst = key_dst + mma_tile * R;
      const T* key = where[2 * at];
      if (key == nullptr) {
        *reinterpret_cast<uint4*>(value_dst) = make_uint4(0, 0, 0, 0);
        continue;
      }
      copy16_async(key_dst, key + my_piece * 8);
      copy16_async(value_dst, where[2 * at + 1] + my_piece * 8);
    }
    __syncwarp();  // the addresses are read before the next tile's lookup overwrites them
  };
#pragma unroll
  for (int t = 0; t < stages - 1; ++t) {
    if (t < tiles) issue(t);
    commit_async();
  }

  // Head gr's query (scale and log2 e folded in) as A fragments: columns 16 ks + 2 t4 (+1)
  // and 16 ks + 8 + 2 t4 (+1), scaled by 2^-e into fp16's range, split into terms.
  const bool real = gr < g.heads;
  float qv[KS][4];
  float biggest = 0.f;
#pragma unroll
  for (int ks = 0; ks < KS; ++ks)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int col = 16 * ks + (i / 2) * 8 + 2 * t4 + i % 2;
      qv[ks][i] = real ? g.q[gr * g.q_stride + col] * (g.scale * log2e) : 0.f;
      biggest = fmaxf(biggest, fabsf(qv[ks][i]));
    }
  biggest = fmaxf(biggest, __shfl_xor_sync(0xffffffffu, biggest, 1));
  biggest = fmaxf(biggest, __shfl_xor_sync(0xffffffffu, biggest, 2));
  const int e = biggest == 0.f ? 0 : max(-100, min(100, int((__float_as_uint(biggest) >> 23) & 0xff) - 127 - 14));
  const float down = exp2f(float(-e)), up = exp2f(float(e));
  unsigned qa[KS][2][NT];
#pragma unroll
  for (int ks = 0; ks < KS; ++ks)
#pragma unroll
    for (int half = 0; half < 2; ++half) terms::split(qv[ks][2 * half] * down, qv[ks][2 * half + 1] * down, qa[ks][half]);

  float o[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m = -INFINITY, l = 0.f;  // head gr's running maximum (base 2) and this lane's share of its sum

  // ldmatrix addresses: lane l gives row l % 8 of matrix l / 8.
  const int mi = lane / 8, r8 = lane % 8;
  const int key_row = warp * 16 + (mi / 2) * 8 + r8, key_col = (mi % 2) * 8;
  const int value_row = warp * 16 + (mi % 2) * 8 + r8, value_col = (mi / 2) * 8;

  for (int t = 0; t < tiles; ++t) {
    wait_async<stages - 2>();
    __syncthreads();
    const T* keys = tile_mem + (t % stages) * stage_elems;
    const T* values = keys + mma_tile * R;
    float s[2][4] = {};
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      unsigned kb[4];
      ldmatrix_x4<false>(kb, keys + key_row * R + 16 * ks + key_col);
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        terms::mma(s[0], qa[ks][0][n], qa[ks][1][n], kb[0], kb[1]);
        terms::mma(s[1], qa[ks][0][n], qa[ks][1][n], kb[2], kb[3]);
      }
    }
    // Head gr's scores of tokens 8 nt + 2 t4 (+1) of this warp's 16; past the chunk: -inf.
    const int first = t * mma_tile + warp * 16 + 2 * t4;
    float z[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) z[i] = first + (i / 2) * 8 + i % 2 < c.tokens ? s[i / 2][i % 2] * up : -INFINITY;
    float top = fmaxf(fmaxf(z[0], z[1]), fmaxf(z[2], z[3]));
    top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
    top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
    const float next = fmaxf(m, top);
    const float r = next == m ? 1.f : exp2f(m - next);  // m = -inf, next finite: 0
    float p[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) p[i] = next == -INFINITY ? 0.f : exp2f(z[i] - next);
    l = l * r + (p[0] + p[1]) + (p[2] + p[3]);
    m = next;
    if (__any_sync(0xffffffffu, r != 1.f)) {
#pragma unroll
      for (int j = 0; j < D / 8; ++j) o[j][0] *= r, o[j][1] *= r;
    }
    unsigned pa[2][NT];  // P's A fragments: tokens 2 t4 (+1), then 8 + 2 t4 (+1)
    terms::split(p[0] * p_scale, p[1] * p_scale, pa[0]);
    terms::split(p[2] * p_scale, p[3] * p_scale, pa[1]);
#pragma unroll
    for (int jj = 0; jj < D / 16; ++jj) {
      unsigned vb[4];
      ldmatrix_x4<true>(vb, values + value_row * R + 16 * jj + value_col);
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        terms::mma(o[2 * jj], pa[0][n], pa[1][n], vb[0], vb[1]);
        terms::mma(o[2 * jj + 1], pa[0][n], pa[1][n], vb[2], vb[3]);
      }
    }
    if (t + stages - 1 < tiles) issue(t + stages - 1);  // into the stage folded one step ago
    commit_async();
  }
  wait_async<0>();
  __syncthreads();  // every fold is done before the tiles' memory holds the merge

  // The four warps' states merged through shared memory, as subgroup_state::store does.
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  float* sm_m = reinterpret_cast<float*>(smem);
  float* sm_l = sm_m + 4 * 8;
  float* sm_o = sm_l + 4 * 8;  // [warp][head][D]
  if (gr < HP) {
    if (t4 == 0) sm_m[warp * 8 + gr] = m, sm_l[warp * 8 + gr] = l;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      sm_o[(warp * 8 + gr) * D + 8 * j + 2 * t4] = o[j][0];
      sm_o[(warp * 8 + gr) * D + 8 * j + 2 * t4 + 1] = o[j][1];
    }
  }
  __syncthreads();
  float* out = work + static_cast<std::int64_t>(blockIdx.x) * HP * (2 + dv_max);
  for (int idx = threadIdx.x; idx < g.heads * D; idx += block_threads) {
    const int h = idx / D, j = idx % D;
    float mm = -INFINITY;
    for (int w = 0; w < 4; ++w) mm = fmaxf(mm, sm_m[w * 8 + h]);
    float ll = 0.f, aa = 0.f;
    for (int w = 0; w < 4; ++w) {
      if (sm_m[w * 8 + h] == -INFINITY) continue;  // a warp that saw no token
      const float scale = exp2f(sm_m[w * 8 + h] - mm);
      ll += scale * sm_l[w * 8 + h];
      aa += scale * sm_o[(w * 8 + h) * D + j];
    }
    if (j == 0) out[h] = mm * ln2, out[HP + h] = ll;
    out[2 * HP + h * dv_max + j] = aa * (1.f / p_scale);
  }
#else
  __trap();  // launched only on compute capability 8.0 and newer (mma_fits)
#endif
}
