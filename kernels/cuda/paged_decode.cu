// Paged decode attention kernels (see paged_decode.cuh for the algorithm and the contract).
#include "kernels/cuda/paged_decode.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <type_traits>

namespace kernels {
namespace {

constexpr int kThreads = 128;  // 4 warps per split block
constexpr int kWarps = kThreads / 32;
constexpr int kSplit = kPagedDecodeSplitTokens;
constexpr int kMmaHeads = kPagedDecodeMmaHeads;
constexpr float kLog2e = 1.4426950408889634f;
constexpr unsigned kFull = 0xffffffffu;

// ---- 16-byte vectors ----

template <typename T>
struct Vec;
template <>
struct Vec<float> {
  static constexpr int kN = 4;
  __device__ static void Convert(const uint4& raw, float* f) {
    f[0] = __uint_as_float(raw.x), f[1] = __uint_as_float(raw.y);
    f[2] = __uint_as_float(raw.z), f[3] = __uint_as_float(raw.w);
  }
};
template <>
struct Vec<__nv_bfloat16> {
  static constexpr int kN = 8;
  __device__ static void Convert(const uint4& raw, float* f) {
    const auto* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 x = __bfloat1622float2(h[i]);
      f[2 * i] = x.x, f[2 * i + 1] = x.y;
    }
  }
};
template <>
struct Vec<__half> {
  static constexpr int kN = 8;
  __device__ static void Convert(const uint4& raw, float* f) {
    const auto* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 x = __half22float2(h[i]);
      f[2 * i] = x.x, f[2 * i + 1] = x.y;
    }
  }
};

template <typename T>
__device__ __forceinline__ uint4 Load16(const T* p) {
  return *reinterpret_cast<const uint4*>(p);
}

// ---- the split's pool rows ----

// The pool blocks of one split, staged in shared memory at the split's start, so that a row's
// address needs no dependent load from the block table in the loops (a split of kSplit tokens
// spans at most kSplit + 1 table entries, for any block size). A power-of-two block size (16, the
// engine's) divides by a shift.
struct SplitBlocks {
  const int32_t* ids;  // shared: table entries first_entry, first_entry + 1, ...
  int first_entry;
  int block_size, shift;  // shift >= 0: block_size == 1 << shift
  __device__ int Entry(int pos) const { return shift >= 0 ? pos >> shift : pos / block_size; }
};

// The element offset, in either pool, of row `pos` (from the sequence's start) for KV head h:
// 64-bit.
__device__ __forceinline__ int64_t RowOffset(const PagedDecodeArgs& a, const SplitBlocks& blocks,
                                             int pos, int h) {
  const int entry = blocks.Entry(pos);
  const int64_t block = blocks.ids[entry - blocks.first_entry];
  const int64_t row = block * blocks.block_size + (pos - entry * blocks.block_size);
  return (row * a.kv_heads + h) * a.head_dim;
}

// Where a split block works: which split of which sequence, for which KV head and which query
// heads of its group; `n` = 0 when the split starts past the sequence.
struct SplitWork {
  int64_t b;
  int split, kvh, start, n, gc;  // gc: query heads of this pass (<= heads per pass)
  int64_t hq0;                   // the pass's first query head
};

__device__ SplitWork Locate(const PagedDecodeArgs& a, int heads_per_pass) {
  SplitWork w;
  w.split = blockIdx.x;
  w.b = blockIdx.z;
  const int group = static_cast<int>(a.q_heads / a.kv_heads);
  const int passes = (group + heads_per_pass - 1) / heads_per_pass;
  w.kvh = blockIdx.y / passes;
  const int g0 = blockIdx.y % passes * heads_per_pass;
  // Lengths past the table are clamped rather than read out of bounds.
  const int len = min(static_cast<int64_t>(a.seq_lens[w.b]), a.max_blocks * a.block_size);
  w.start = w.split * kSplit;
  w.n = w.start < len ? min(kSplit, len - w.start) : 0;
  w.gc = min(heads_per_pass, group - g0);
  w.hq0 = static_cast<int64_t>(w.kvh) * group + g0;
  return w;
}

// Stages the split's block-table entries in `ids` (kSplit + 1 of them at most).
__device__ SplitBlocks StageBlocks(const PagedDecodeArgs& a, const SplitWork& w, int32_t* ids) {
  const int bs = static_cast<int>(a.block_size);
  const SplitBlocks blocks{ids, w.start / bs, bs, (bs & (bs - 1)) == 0 ? __ffs(bs) - 1 : -1};
  for (int e = blocks.first_entry + threadIdx.x; e <= (w.start + w.n - 1) / bs; e += kThreads)
    ids[e - blocks.first_entry] = a.block_tables[w.b * a.max_blocks + e];
  return blocks;
}

// ---------------------------------------------------------------------------------------------
// CUDA cores. A row of D elements is kVecsRow 16-byte vectors, spread over kLanesRow lanes
// (kVecsLane each); a warp holds kRowsWarp such row groups, the block kSlots. Slot s streams the
// split's tokens s, s + kSlots, ..., kUnroll of them per step with all their K and V vectors
// loaded before any is used, and keeps its own online softmax for the G query heads.
// ---------------------------------------------------------------------------------------------
template <typename T, int D>
struct Cores {
  static constexpr int kVec = Vec<T>::kN;
  static constexpr int kVecsRow = D / kVec;
  static constexpr int kLanesRow = kVecsRow < 32 ? kVecsRow : 32;
  static constexpr int kVecsLane = kVecsRow / kLanesRow;
  static constexpr int kRowsWarp = 32 / kLanesRow;
  static constexpr int kSlots = kWarps * kRowsWarp;
  static constexpr int kUnroll = 4 / kVecsLane;
  static constexpr int kDims = kVecsLane * kVec;  // dims a lane holds
  static constexpr int kMaxGroup = kDims <= 4 ? 8 : 4;
  static_assert(kVecsRow % kLanesRow == 0 && kUnroll >= 1, "row layout");
  template <int G>
  static constexpr size_t SmemBytes() {
    return sizeof(float) * kSlots * G * (2 + D);
  }
  // The first dim of vector v of lane li.
  __device__ static int Dim(int v, int li) { return (v * kLanesRow + li) * kVec; }
};

template <typename T, int D, int G>
__global__ void __launch_bounds__(kThreads) SplitCores(PagedDecodeArgs a) {
  using C = Cores<T, D>;
  const SplitWork w = Locate(a, G);
  if (w.n == 0) return;  // past this sequence: the reduce reads only its own splits
  __shared__ int32_t ids_s[kSplit + 1];
  extern __shared__ float merge[];  // [kSlots][G] m, [kSlots][G] l, [kSlots][G][D] acc
  const SplitBlocks blocks = StageBlocks(a, w, ids_s);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int sub = lane / C::kLanesRow, li = lane % C::kLanesRow;
  const int slot = warp * C::kRowsWarp + sub;
  const float qscale = a.scale * kLog2e;  // scores in log2 units: exp2 in the softmax
  float q[G][C::kDims];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const float* qg = a.q + (w.b * a.q_heads + w.hq0 + g) * D;
#pragma unroll
    for (int v = 0; v < C::kVecsLane; ++v)
#pragma unroll
      for (int e = 0; e < C::kVec; ++e)
        q[g][v * C::kVec + e] = g < w.gc ? qg[C::Dim(v, li) + e] * qscale : 0.0f;
  }
  float acc[G][C::kDims], m[G], l[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < C::kDims; ++e) acc[g][e] = 0.0f;
  }
  __syncthreads();  // the block ids

  const T* kp = static_cast<const T*>(a.k_pool);
  const T* vp = static_cast<const T*>(a.v_pool);
  // w0 is uniform across the warp, so every lane takes part in every shuffle.
  for (int w0 = warp * C::kRowsWarp; w0 < w.n; w0 += C::kSlots * C::kUnroll) {
    // Tokens past the split stay zero (their scores are then set to -inf, their weights to 0).
    uint4 kr[C::kUnroll][C::kVecsLane] = {}, vr[C::kUnroll][C::kVecsLane] = {};
#pragma unroll
    for (int u = 0; u < C::kUnroll; ++u) {
      const int j = w0 + sub + u * C::kSlots;
      if (j < w.n) {
        const int64_t off = RowOffset(a, blocks, w.start + j, w.kvh);
#pragma unroll
        for (int v = 0; v < C::kVecsLane; ++v) {
          kr[u][v] = Load16(kp + off + C::Dim(v, li));
          vr[u][v] = Load16(vp + off + C::Dim(v, li));
        }
      }
    }
    float s[C::kUnroll][G];
#pragma unroll
    for (int u = 0; u < C::kUnroll; ++u) {
      const bool valid = w0 + sub + u * C::kSlots < w.n;
      float kf[C::kDims];
#pragma unroll
      for (int v = 0; v < C::kVecsLane; ++v) Vec<T>::Convert(kr[u][v], kf + v * C::kVec);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < C::kDims; ++e) dot = fmaf(q[g][e], kf[e], dot);
#pragma unroll
        for (int o = C::kLanesRow / 2; o > 0; o /= 2) dot += __shfl_xor_sync(kFull, dot, o);
        s[u][g] = valid ? dot : -INFINITY;
      }
    }
    float vf[C::kUnroll][C::kDims];
#pragma unroll
    for (int u = 0; u < C::kUnroll; ++u)
#pragma unroll
      for (int v = 0; v < C::kVecsLane; ++v) Vec<T>::Convert(vr[u][v], vf[u] + v * C::kVec);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float mx = s[0][g];
#pragma unroll
      for (int u = 1; u < C::kUnroll; ++u) mx = fmaxf(mx, s[u][g]);
      const float mn = fmaxf(m[g], mx);
      if (mn == -INFINITY) continue;  // no token of this step is this row group's
      const float alpha = exp2f(m[g] - mn);
      float p[C::kUnroll], ps = 0.0f;
#pragma unroll
      for (int u = 0; u < C::kUnroll; ++u) {
        p[u] = exp2f(s[u][g] - mn);  // an invalid token's -inf gives 0
        ps += p[u];
      }
      l[g] = l[g] * alpha + ps;
#pragma unroll
      for (int e = 0; e < C::kDims; ++e) {
        float x = acc[g][e] * alpha;
#pragma unroll
        for (int u = 0; u < C::kUnroll; ++u) x = fmaf(p[u], vf[u][e], x);
        acc[g][e] = x;
      }
      m[g] = mn;
    }
  }

  // Merge the row groups in a fixed order (deterministic): M = max m, L = sum 2^(m - M) l,
  // O = sum 2^(m - M) acc.
  float* sm_m = merge;
  float* sm_l = sm_m + C::kSlots * G;
  float* sm_acc = sm_l + C::kSlots * G;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (li == 0) sm_m[slot * G + g] = m[g], sm_l[slot * G + g] = l[g];
#pragma unroll
    for (int v = 0; v < C::kVecsLane; ++v)
#pragma unroll
      for (int e = 0; e < C::kVec; ++e)
        sm_acc[(slot * G + g) * D + C::Dim(v, li) + e] = acc[g][v * C::kVec + e];
  }
  __syncthreads();
  const int64_t part = (w.b * a.q_heads + w.hq0) * a.num_splits + w.split;  // head g: + g * splits
  for (int i = threadIdx.x; i < w.gc * D; i += kThreads) {
    const int g = i / D, d = i % D;
    float M = -INFINITY;
    for (int s = 0; s < C::kSlots; ++s) M = fmaxf(M, sm_m[s * G + g]);
    float L = 0.0f, O = 0.0f;
    for (int s = 0; s < C::kSlots; ++s) {
      const float f = exp2f(sm_m[s * G + g] - M);  // slot 0 always saw token 0: M is finite
      L = fmaf(f, sm_l[s * G + g], L);
      O = fmaf(f, sm_acc[(s * G + g) * D + d], O);
    }
    const int64_t at = part + static_cast<int64_t>(g) * a.num_splits;
    a.part_acc[at * D + d] = O;
    if (d == 0) a.part_ml[at * 2] = M, a.part_ml[at * 2 + 1] = L;
  }
}

// ---------------------------------------------------------------------------------------------
// Tensor cores (bf16 / fp16). Shared memory rows are padded by 8 elements (16 bytes), so that
// the 8 row addresses of one ldmatrix phase fall into 8 distinct 16-byte bank groups.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; zero-fills the destination when !valid (nothing is read then).
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// c += a (16x16, row-major) * b (16x8, "col": k contiguous per column), fp32 accumulators.
template <typename T>
__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

template <typename T>
__device__ __forceinline__ T FromF(float v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(v);
  } else {
    return __float2half_rn(v);
  }
}

// (x, y) as a pair of T in one register (x in the low half: the lower k index), split into a
// high part and the rounded rest: x = hi + lo to ~16 significant bits (bf16) or ~22 (fp16).
template <typename T>
__device__ __forceinline__ void SplitPair(float x, float y, uint32_t* hi, uint32_t* lo) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    const float2 hf = __bfloat1622float2(h);
    const __nv_bfloat162 r = __floats2bfloat162_rn(x - hf.x, y - hf.y);
    *hi = *reinterpret_cast<const uint32_t*>(&h);
    *lo = *reinterpret_cast<const uint32_t*>(&r);
  } else {
    const __half2 h = __floats2half2_rn(x, y);
    const float2 hf = __half22float2(h);
    const __half2 r = __floats2half2_rn(x - hf.x, y - hf.y);
    *hi = *reinterpret_cast<const uint32_t*>(&h);
    *lo = *reinterpret_cast<const uint32_t*>(&r);
  }
}

template <int D>
struct MmaShape {
  static constexpr int kLds = D + 8;            // elements per shared row
  static constexpr int kTileElems = 16 * kLds;  // a 16-row tile
  static constexpr int kTilesPerWarp = 4;       // 2 stages x (K, V)
  static constexpr int kKSteps = D / 16;        // k steps of Q K^T
  static constexpr int kNTiles = D / 8;         // n8 tiles of O
  static constexpr int kChunks = D / 8;         // 16-byte chunks of a row
  static constexpr size_t kSmemBytes = sizeof(uint16_t) * kTileElems * (1 + kWarps * kTilesPerWarp);
  static_assert(sizeof(float) * kWarps * 16 * (2 + D) <=
                    sizeof(uint16_t) * kTileElems * kWarps * kTilesPerWarp,
                "the merge reuses the tiles' shared memory");
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) SplitMma(PagedDecodeArgs a) {
  using S = MmaShape<D>;
  constexpr int kLds = S::kLds;
  const SplitWork w = Locate(a, kMmaHeads);
  if (w.n == 0) return;
  __shared__ int32_t ids_s[kSplit + 1];
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* q_s = reinterpret_cast<T*>(smem_raw);  // [16][kLds]: the pass's query heads, 0 past gc
  T* tiles = q_s + S::kTileElems;           // per warp: stage 0 K, V, stage 1 K, V
  const SplitBlocks blocks = StageBlocks(a, w, ids_s);
  for (int i = threadIdx.x; i < 16 * D; i += kThreads) {
    const int r = i / D, d = i % D;
    q_s[r * kLds + d] = FromF<T>(r < w.gc ? a.q[(w.b * a.q_heads + w.hq0 + r) * D + d] : 0.0f);
  }
  __syncthreads();  // q_s and the block ids

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint32_t qa[S::kKSteps][4];
#pragma unroll
  for (int ks = 0; ks < S::kKSteps; ++ks)
    LdMatrixX4(qa[ks], SmemAddr(q_s + (lane & 15) * kLds + ks * 16 + (lane >> 4) * 8));

  const T* kp = static_cast<const T*>(a.k_pool);
  const T* vp = static_cast<const T*>(a.v_pool);
  T* mine = tiles + warp * S::kTilesPerWarp * S::kTileElems;
  // Tile t (tokens 16 t .. 16 t + 15 of the split) into stage st; rows past n are zero.
  auto load = [&](int t, int st) {
    T* kd = mine + (2 * st) * S::kTileElems;
    T* vd = kd + S::kTileElems;
    for (int c = lane; c < 16 * S::kChunks; c += 32) {
      const int r = c / S::kChunks, ch = c % S::kChunks, tok = 16 * t + r;
      const bool ok = tok < w.n;
      const int64_t off = ok ? RowOffset(a, blocks, w.start + tok, w.kvh) + ch * 8 : 0;
      CpAsync16(SmemAddr(kd + r * kLds + ch * 8), kp + off, ok);
      CpAsync16(SmemAddr(vd + r * kLds + ch * 8), vp + off, ok);
    }
  };

  float o[S::kNTiles][4];
#pragma unroll
  for (int nt = 0; nt < S::kNTiles; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows lane/4 and lane/4 + 8
  const float sl = a.scale * kLog2e;
  const int c = lane & 3;
  const int tiles_total = (w.n + 15) / 16;
  int st = 0;
  if (warp < tiles_total) load(warp, 0);
  CpAsyncCommit();
  for (int t = warp; t < tiles_total; t += kWarps, st ^= 1) {
    if (t + kWarps < tiles_total) load(t + kWarps, st ^ 1);
    CpAsyncCommit();   // always, so that the group count stays uniform
    CpAsyncWait<1>();  // tile t has landed (for this lane's copies) ...
    __syncwarp();      // ... and for every lane's
    const T* ks_ = mine + (2 * st) * S::kTileElems;
    const T* vs_ = ks_ + S::kTileElems;

    // S = Q K^T: n-tile 0 tokens 0-7, n-tile 1 tokens 8-15.
    float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
    for (int ks = 0; ks < S::kKSteps; ++ks) {
      uint32_t kb[4];
      LdMatrixX4(kb, SmemAddr(ks_ + ((lane & 7) + ((lane >> 4) << 3)) * kLds + ks * 16 +
                              ((lane >> 3) & 1) * 8));
      Mma<T>(s[0], qa[ks], kb[0], kb[1]);
      Mma<T>(s[1], qa[ks], kb[2], kb[3]);
    }
    // Element e of n-tile j: row lane/4 + 8 (e / 2), token 8 j + 2 c + e % 2.
    const int nv = min(16, w.n - 16 * t);
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tok = 8 * j + 2 * c + (e & 1);
        s[j][e] = tok < nv ? s[j][e] * sl : -INFINITY;
        mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
      }
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(kFull, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(kFull, mx[h], 2));
      const float mn = fmaxf(m[h], mx[h]);  // finite: token 0 of the tile is valid
      alpha[h] = exp2f(m[h] - mn);
      m[h] = mn;
    }
    float p[2][4], rs[2] = {0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        p[j][e] = exp2f(s[j][e] - m[e >> 1]);
        rs[e >> 1] += p[j][e];
      }
#pragma unroll
    for (int h = 0; h < 2; ++h) l[h] = l[h] * alpha[h] + rs[h];
#pragma unroll
    for (int nt = 0; nt < S::kNTiles; ++nt) {
      o[nt][0] *= alpha[0], o[nt][1] *= alpha[0];
      o[nt][2] *= alpha[1], o[nt][3] *= alpha[1];
    }
    // P as the A operand (16 heads x 16 tokens) from the accumulators of the two n-tiles.
    uint32_t ph[4], pl[4];
    SplitPair<T>(p[0][0], p[0][1], &ph[0], &pl[0]);
    SplitPair<T>(p[0][2], p[0][3], &ph[1], &pl[1]);
    SplitPair<T>(p[1][0], p[1][1], &ph[2], &pl[2]);
    SplitPair<T>(p[1][2], p[1][3], &ph[3], &pl[3]);
    // O += P V: V [16 tokens][D] read transposed, 16 dims (two n-tiles) per ldmatrix.
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t vb[4];
      LdMatrixX4Trans(vb, SmemAddr(vs_ + ((lane & 7) + ((lane >> 3) & 1) * 8) * kLds + dp * 16 +
                                   (lane >> 4) * 8));
      Mma<T>(o[2 * dp], ph, vb[0], vb[1]);
      Mma<T>(o[2 * dp], pl, vb[0], vb[1]);
      Mma<T>(o[2 * dp + 1], ph, vb[2], vb[3]);
      Mma<T>(o[2 * dp + 1], pl, vb[2], vb[3]);
    }
    __syncwarp();  // every lane is done with this stage before it is refilled
  }
  CpAsyncWait<0>();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(kFull, l[h], 1);
    l[h] += __shfl_xor_sync(kFull, l[h], 2);
  }

  // Merge the warps in a fixed order, in the tiles' shared memory.
  __syncthreads();
  float* cm = reinterpret_cast<float*>(tiles);  // [kWarps][16] m
  float* cl = cm + kWarps * 16;                 // [kWarps][16] l
  float* co = cl + kWarps * 16;                 // [kWarps][16][D]
  const int g = lane >> 2;
  if (c == 0) {
    cm[warp * 16 + g] = m[0], cm[warp * 16 + g + 8] = m[1];
    cl[warp * 16 + g] = l[0], cl[warp * 16 + g + 8] = l[1];
  }
#pragma unroll
  for (int nt = 0; nt < S::kNTiles; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      co[(warp * 16 + g + 8 * (e >> 1)) * D + 8 * nt + 2 * c + (e & 1)] = o[nt][e];
  __syncthreads();
  const int64_t part = (w.b * a.q_heads + w.hq0) * a.num_splits + w.split;
  for (int i = threadIdx.x; i < w.gc * D; i += kThreads) {
    const int r = i / D, d = i % D;
    float M = -INFINITY;
    for (int v = 0; v < kWarps; ++v) M = fmaxf(M, cm[v * 16 + r]);
    float L = 0.0f, O = 0.0f;
    for (int v = 0; v < kWarps; ++v) {
      const float f = exp2f(cm[v * 16 + r] - M);  // warp 0 always has tile 0: M is finite
      L = fmaf(f, cl[v * 16 + r], L);
      O = fmaf(f, co[(v * 16 + r) * D + d], O);
    }
    const int64_t at = part + static_cast<int64_t>(r) * a.num_splits;
    a.part_acc[at * D + d] = O;
    if (d == 0) a.part_ml[at * 2] = M, a.part_ml[at * 2 + 1] = L;
  }
}

// out[b, h] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the sequence's splits.
__global__ void __launch_bounds__(kThreads) PagedDecodeReduce(PagedDecodeArgs a) {
  const int64_t h = blockIdx.x, b = blockIdx.y;
  const int64_t D = a.head_dim, base = (b * a.q_heads + h) * a.num_splits;
  const int ns = min((static_cast<int64_t>(a.seq_lens[b]) + kSplit - 1) / kSplit, a.num_splits);
  extern __shared__ float w_s[];  // [num_splits]: the splits' weights
  for (int s = threadIdx.x; s < ns; s += kThreads) w_s[s] = a.part_ml[(base + s) * 2];
  __syncthreads();
  float m = -INFINITY;
  for (int s = 0; s < ns; ++s) m = fmaxf(m, w_s[s]);
  __syncthreads();
  for (int s = threadIdx.x; s < ns; s += kThreads) w_s[s] = exp2f(w_s[s] - m);
  __syncthreads();
  float l = 0.0f;
  for (int s = 0; s < ns; ++s) l += w_s[s] * a.part_ml[(base + s) * 2 + 1];
  const float inv = ns > 0 ? 1.0f / l : 0.0f;
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    float o = 0.0f;
    for (int s = 0; s < ns; ++s) o = fmaf(w_s[s], a.part_acc[(base + s) * D + d], o);
    a.out[(b * a.q_heads + h) * D + d] = o * inv;
  }
}

dim3 SplitGrid(const PagedDecodeArgs& a, int heads_per_pass) {
  const int64_t group = a.q_heads / a.kv_heads;
  const int64_t passes = (group + heads_per_pass - 1) / heads_per_pass;
  return dim3(static_cast<unsigned>(a.num_splits), static_cast<unsigned>(a.kv_heads * passes),
              static_cast<unsigned>(a.batch));
}

template <typename T, int D, int G>
cudaError_t LaunchCoresG(const PagedDecodeArgs& a, cudaStream_t stream) {
  constexpr size_t kBytes = Cores<T, D>::template SmemBytes<G>();
  static_assert(kBytes + sizeof(int32_t) * (kSplit + 1) <= 48 * 1024, "no opt-in needed");
  SplitCores<T, D, G><<<SplitGrid(a, G), kThreads, kBytes, stream>>>(a);
  return cudaGetLastError();
}

// G: the group rounded up to a power of two, at most the layout's register budget.
template <typename T, int D>
cudaError_t LaunchCores(const PagedDecodeArgs& a, cudaStream_t stream) {
  const int64_t group = a.q_heads / a.kv_heads;
  if (group == 1) return LaunchCoresG<T, D, 1>(a, stream);
  if (group == 2) return LaunchCoresG<T, D, 2>(a, stream);
  if (group <= 4 || Cores<T, D>::kMaxGroup == 4) return LaunchCoresG<T, D, 4>(a, stream);
  if constexpr (Cores<T, D>::kMaxGroup >= 8) return LaunchCoresG<T, D, 8>(a, stream);
  return cudaErrorInvalidValue;
}

template <typename T, int D>
cudaError_t LaunchMma(const PagedDecodeArgs& a, cudaStream_t stream) {
  constexpr size_t kBytes = MmaShape<D>::kSmemBytes;
  auto* kernel = &SplitMma<T, D>;
  if (kBytes + sizeof(int32_t) * (kSplit + 1) > 48 * 1024) {
    const cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
    if (e != cudaSuccess) return e;
  }
  kernel<<<SplitGrid(a, kMmaHeads), kThreads, kBytes, stream>>>(a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchCoresFor(const PagedDecodeArgs& a, cudaStream_t stream) {
  switch (a.head_dim) {
    case 64:
      return LaunchCores<T, 64>(a, stream);
    case 128:
      return LaunchCores<T, 128>(a, stream);
    case 256:
      return LaunchCores<T, 256>(a, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t LaunchMmaFor(const PagedDecodeArgs& a, cudaStream_t stream) {
  switch (a.head_dim) {
    case 64:
      return LaunchMma<T, 64>(a, stream);
    case 128:
      return LaunchMma<T, 128>(a, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

bool MmaApplies(const PagedDecodeArgs& a) {
  return (a.dtype == KvDtype::kBFloat16 || a.dtype == KvDtype::kFloat16) &&
         (a.head_dim == 64 || a.head_dim == 128) && a.q_in_kv_dtype;
}

}  // namespace

int64_t PagedDecodeNumSplits(int64_t max_blocks, int64_t block_size) {
  return (max_blocks * block_size + kSplit - 1) / kSplit;
}

bool PagedDecodeSupports(int64_t head_dim, int64_t q_heads, int64_t kv_heads) {
  return (head_dim == 64 || head_dim == 128 || head_dim == 256) && kv_heads > 0 &&
         q_heads % kv_heads == 0 && q_heads > 0;
}

PagedDecodePath PagedDecodeChosenPath(const PagedDecodeArgs& a) {
  switch (a.path) {
    case PagedDecodePath::kCudaCores:
      return PagedDecodePath::kCudaCores;
    case PagedDecodePath::kTensorCores:
      return MmaApplies(a) ? PagedDecodePath::kTensorCores : PagedDecodePath::kAuto;
    case PagedDecodePath::kAuto:
      break;
  }
  return MmaApplies(a) && a.q_heads / a.kv_heads >= 4 ? PagedDecodePath::kTensorCores
                                                      : PagedDecodePath::kCudaCores;
}

cudaError_t PagedDecode(const PagedDecodeArgs& a, cudaStream_t stream) {
  if (!PagedDecodeSupports(a.head_dim, a.q_heads, a.kv_heads) || a.block_size <= 0 ||
      a.num_splits != PagedDecodeNumSplits(a.max_blocks, a.block_size) || a.batch > 65535 ||
      a.num_splits > 12 * 1024)
    return cudaErrorInvalidValue;
  const PagedDecodePath path = PagedDecodeChosenPath(a);
  if (path == PagedDecodePath::kAuto) return cudaErrorInvalidValue;  // tensor cores do not apply
  if (a.batch == 0 || a.num_splits == 0) return cudaSuccess;
  cudaError_t e = cudaErrorInvalidValue;
  const bool mma = path == PagedDecodePath::kTensorCores;
  switch (a.dtype) {
    case KvDtype::kFloat32:
      e = LaunchCoresFor<float>(a, stream);
      break;
    case KvDtype::kBFloat16:
      e = mma ? LaunchMmaFor<__nv_bfloat16>(a, stream) : LaunchCoresFor<__nv_bfloat16>(a, stream);
      break;
    case KvDtype::kFloat16:
      e = mma ? LaunchMmaFor<__half>(a, stream) : LaunchCoresFor<__half>(a, stream);
      break;
  }
  if (e != cudaSuccess) return e;
  const dim3 grid(static_cast<unsigned>(a.q_heads), static_cast<unsigned>(a.batch));
  PagedDecodeReduce<<<grid, kThreads, sizeof(float) * a.num_splits, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace kernels
