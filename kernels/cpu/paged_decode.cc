// Paged decode attention on the CPU (see paged_decode.h). Compiled with -fopenmp, like
// cpu_inference.cc: at::parallel_for's region is compiled inline here.
#include "kernels/cpu/paged_decode.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/parallel_tasks.h"

namespace lm {
namespace {

// Only these functions use AVX2/FMA instructions (per-function target, as in cpu_kernels.cc), and
// callers reach them only where cpu::HasAvx2Fma(). The loops over a group's query heads (g < GC)
// are unrolled explicitly: left as loops, their arrays of vectors live on the stack and every FMA
// waits on a store and a load.
#define OPD_AVX2 __attribute__((target("avx2,fma")))

using BF16 = c10::BFloat16;

OPD_AVX2 inline __m256 Load8(const float* p) {
  return _mm256_loadu_ps(p);
}
// bf16 is the high half of an fp32: widen to 32 bits and shift up.
OPD_AVX2 inline __m256 Load8(const BF16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float ToFloat(float x) {
  return x;
}
inline float ToFloat(BF16 x) {
  return static_cast<float>(x);
}

OPD_AVX2 inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The horizontal sums of eight vectors at once, in one vector (lane g: the sum of a[g]).
OPD_AVX2 inline __m256 HorizontalSums8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Where one task reads: the rows of KV head `head` in the pools, `stride` elements apart.
template <typename T>
struct KvView {
  const T* k;
  const T* v;
  int64_t block_size, stride, head_dim;
  const T* KRow(int64_t block, int64_t row) const {
    return k + (block * block_size + row) * stride;
  }
  const T* VRow(int64_t block, int64_t row) const {
    return v + (block * block_size + row) * stride;
  }
};

// s[g * ld + r] = q_g . k_r for GC query heads and rows r < n of one block: each K row is loaded
// once for all GC heads.
template <int GC, typename T>
OPD_AVX2 void BlockScores(const float* q, const KvView<T>& kv, int64_t block, int64_t n, float* s,
                          int64_t ld) {
  const int64_t D = kv.head_dim, D8 = D / 8 * 8;
  for (int64_t r = 0; r < n; ++r) {
    const T* k = kv.KRow(block, r);
    __m256 acc[GC];
#pragma GCC unroll 8
    for (int g = 0; g < GC; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D8; d += 8) {
      const __m256 kd = Load8(k + d);
#pragma GCC unroll 8
      for (int g = 0; g < GC; ++g) acc[g] = _mm256_fmadd_ps(Load8(q + g * D + d), kd, acc[g]);
    }
    float dot[GC];
    if constexpr (GC == 8) {
      _mm256_storeu_ps(dot, HorizontalSums8(acc));
    } else {
#pragma GCC unroll 8
      for (int g = 0; g < GC; ++g) dot[g] = HorizontalSum(acc[g]);
    }
    for (int64_t d = D8; d < D; ++d)
#pragma GCC unroll 8
      for (int g = 0; g < GC; ++g) dot[g] += q[g * D + d] * ToFloat(k[d]);
#pragma GCC unroll 8
    for (int g = 0; g < GC; ++g) s[g * ld + r] = dot[g];
  }
}

// out[g] += sum_r p[g * ld + r] v_r for GC query heads: each V row is loaded once for all of them,
// the outputs stay in registers across the block's rows.
template <int GC, typename T>
OPD_AVX2 void BlockValues(const float* p, int64_t ld, const KvView<T>& kv, int64_t block, int64_t n,
                          float* out) {
  const int64_t D = kv.head_dim, D8 = D / 8 * 8;
  for (int64_t d = 0; d < D8; d += 8) {
    __m256 acc[GC];
#pragma GCC unroll 8
    for (int g = 0; g < GC; ++g) acc[g] = _mm256_loadu_ps(out + g * D + d);
    for (int64_t r = 0; r < n; ++r) {
      const __m256 vd = Load8(kv.VRow(block, r) + d);
#pragma GCC unroll 8
      for (int g = 0; g < GC; ++g)
        acc[g] = _mm256_fmadd_ps(_mm256_set1_ps(p[g * ld + r]), vd, acc[g]);
    }
#pragma GCC unroll 8
    for (int g = 0; g < GC; ++g) _mm256_storeu_ps(out + g * D + d, acc[g]);
  }
  for (int64_t d = D8; d < D; ++d)
    for (int64_t r = 0; r < n; ++r) {
      const float vd = ToFloat(kv.VRow(block, r)[d]);
#pragma GCC unroll 8
      for (int g = 0; g < GC; ++g) out[g * D + d] += p[g * ld + r] * vd;
    }
}

// Starts loading part `part` of `parts` of a block of a pool (one block is block_size * Hkv * D
// contiguous elements): blocks lie anywhere in the pool, which the hardware prefetcher cannot
// guess, so the next block is requested while this one is computed, a share per KV head.
template <typename T>
void PrefetchBlock(const T* pool, int64_t block_elems, int64_t block, int64_t part, int64_t parts) {
  const char* base = reinterpret_cast<const char*>(pool + block * block_elems);
  const int64_t bytes = block_elems * static_cast<int64_t>(sizeof(T));
  for (int64_t o = bytes * part / parts; o < bytes * (part + 1) / parts; o += 64)
    _mm_prefetch(base + o, _MM_HINT_T0);
}

// One task's running softmax state for its G query heads.
struct Partial {
  float* acc;  // [G][D] sum of p * V (unnormalised)
  float* m;    // [G] running max
  float* l;    // [G] running sum of exp(s - m)
};

// Folds a block's scores s [G][ld] (rows < n) into the running state, leaving p = exp(s - m) in s.
void OnlineSoftmax(float* s, int64_t ld, int64_t n, int64_t G, int64_t D, const Partial& part) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * ld;
    const float m_new = std::max(part.m[g], *std::max_element(sg, sg + n));
    const float alpha = std::exp(part.m[g] - m_new);  // 0 for the first block (m = -inf)
    float sum = 0.0f;
    for (int64_t r = 0; r < n; ++r) sum += sg[r] = std::exp(sg[r] - m_new);
    part.l[g] = part.l[g] * alpha + sum;
    part.m[g] = m_new;
    if (alpha != 1.0f)
      for (int64_t d = 0; d < D; ++d) part.acc[g * D + d] *= alpha;
  }
}

struct Task {
  int64_t b, split, tokens;
};

// The splits of every sequence, longest first (ties in index order: deterministic). A task takes
// every KV head of its blocks: a block is one contiguous run of memory ([block_size, Hkv, D]),
// read once, front to back; a task per head would stride through it Hkv times.
std::vector<Task> MakeTasks(const int32_t* lens, int64_t B) {
  std::vector<Task> tasks;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s * kPagedDecodeCpuSplitTokens < lens[b]; ++s)
      tasks.push_back(
          {b, s, std::min(kPagedDecodeCpuSplitTokens, lens[b] - s * kPagedDecodeCpuSplitTokens)});
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& x, const Task& y) { return x.tokens > y.tokens; });
  return tasks;
}

// Everything a split task reads and writes.
struct Problem {
  const float* q;  // [B, Hq, D] fp32, scaled
  const int32_t* tables;
  int64_t max_blocks, Hq, Hkv, D, splits;
  float* part_acc;  // [B, Hq, splits, D]
  float* part_ml;   // [B, Hq, splits, 2]
};

template <int GC, typename T>
OPD_AVX2 void RunSplit(const Problem& pr, const KvView<T>& pools, const Task& t,
                       std::vector<float>& scores) {
  const int64_t G = pr.Hq / pr.Hkv, D = pr.D, bs = pools.block_size, Hkv = pr.Hkv;
  const int64_t block_elems = bs * Hkv * D;
  const float* q = pr.q + t.b * pr.Hq * D;
  // Per query head of the sequence (KV head h's group: rows h * G ..), the running state.
  std::vector<float> acc(pr.Hq * D, 0.0f), m(pr.Hq, -std::numeric_limits<float>::infinity()),
      l(pr.Hq, 0.0f);
  const int64_t first = t.split * kPagedDecodeCpuSplitTokens, end = first + t.tokens;
  const int32_t* table = pr.tables + t.b * pr.max_blocks;
  // Splits start on block boundaries whenever block_size divides the split size (16, 32); others
  // work too, a block being read in two pieces.
  for (int64_t pos = first; pos < end;) {
    const int64_t block = table[pos / bs], row0 = pos % bs;
    const int64_t n = std::min(bs - row0, end - pos),
                  next = pos + n < end ? table[(pos + n) / bs] : -1;
    for (int64_t h = 0; h < Hkv; ++h) {
      if (next >= 0) {
        PrefetchBlock(pools.k, block_elems, next, h, Hkv);
        PrefetchBlock(pools.v, block_elems, next, h, Hkv);
      }
      KvView<T> at = pools;
      at.k += row0 * pools.stride + h * D;
      at.v += row0 * pools.stride + h * D;
      const Partial part{acc.data() + h * G * D, m.data() + h * G, l.data() + h * G};
      for (int64_t g = 0; g < G; g += GC)
        BlockScores<GC>(q + (h * G + g) * D, at, block, n, scores.data() + g * bs, bs);
      OnlineSoftmax(scores.data(), bs, n, G, D, part);
      for (int64_t g = 0; g < G; g += GC)
        BlockValues<GC>(scores.data() + g * bs, bs, at, block, n, part.acc + g * D);
    }
    pos += n;
  }
  for (int64_t h = 0; h < pr.Hq; ++h) {
    const int64_t p = (t.b * pr.Hq + h) * pr.splits + t.split;
    std::copy_n(acc.data() + h * D, D, pr.part_acc + p * D);
    pr.part_ml[p * 2] = m[h];
    pr.part_ml[p * 2 + 1] = l[h];
  }
}

// out[row] = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s over the row's splits, in order.
void MergeSplits(const Problem& pr, const int32_t* lens, int64_t B, float* out) {
  at::parallel_for(0, B * pr.Hq, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> w(pr.splits);
    for (int64_t row = r0; row < r1; ++row) {
      const int64_t ns =
          (lens[row / pr.Hq] + kPagedDecodeCpuSplitTokens - 1) / kPagedDecodeCpuSplitTokens;
      const float* ml = pr.part_ml + row * pr.splits * 2;
      const float* acc = pr.part_acc + row * pr.splits * pr.D;
      float M = -std::numeric_limits<float>::infinity(), L = 0.0f;
      for (int64_t s = 0; s < ns; ++s) M = std::max(M, ml[s * 2]);
      for (int64_t s = 0; s < ns; ++s) L += (w[s] = std::exp(ml[s * 2] - M)) * ml[s * 2 + 1];
      float* o = out + row * pr.D;
      std::fill_n(o, pr.D, 0.0f);
      for (int64_t s = 0; s < ns; ++s)
        for (int64_t d = 0; d < pr.D; ++d) o[d] += w[s] * acc[s * pr.D + d];
      const float inv = ns > 0 ? 1.0f / L : 0.0f;
      for (int64_t d = 0; d < pr.D; ++d) o[d] *= inv;
    }
  });
}

// The largest group of query heads (<= 8) that divides G: the registers one pass holds.
int GroupChunk(int64_t G) {
  return G % 8 == 0 ? 8 : G % 4 == 0 ? 4 : G % 2 == 0 ? 2 : 1;
}

template <typename T>
void RunAll(const Problem& pr, const KvView<T>& pools, const std::vector<Task>& tasks) {
  const int64_t G = pr.Hq / pr.Hkv;
  auto run = [&](auto gc) {
    ParallelTasks(
        static_cast<int64_t>(tasks.size()),
        [&] { return std::vector<float>(G * pools.block_size); },
        [&](int64_t i, std::vector<float>& scores) {
          RunSplit<decltype(gc)::value>(pr, pools, tasks[i], scores);
        });
  };
  switch (GroupChunk(G)) {
    case 8:
      return run(std::integral_constant<int, 8>());
    case 4:
      return run(std::integral_constant<int, 4>());
    case 2:
      return run(std::integral_constant<int, 2>());
    default:
      return run(std::integral_constant<int, 1>());
  }
}

void CheckTables(const int32_t* tables, const int32_t* lens, int64_t B, int64_t max_blocks,
                 int64_t block_size, int64_t num_blocks) {
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * block_size, "PagedDecodeCpu: seq_lens[", b,
                "] = ", lens[b], " outside [1, ", max_blocks * block_size, "]");
    for (int64_t i = 0; i < (lens[b] + block_size - 1) / block_size; ++i) {
      const int32_t id = tables[b * max_blocks + i];
      TORCH_CHECK(id >= 0 && id < num_blocks, "PagedDecodeCpu: block ", id, " out of range");
    }
  }
}

}  // namespace

bool UseCpuPagedDecode(const torch::Tensor& q, const torch::Tensor& k_pool,
                       const torch::Tensor& v_pool, const torch::Tensor& block_tables,
                       const torch::Tensor& seq_lens) {
  auto cpu = [](const torch::Tensor& t) { return t.device().is_cpu() && !t.requires_grad(); };
  auto kv_dtype = [](const torch::Tensor& t) {
    return t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16;
  };
  if (!cpu(q) || !cpu(k_pool) || !cpu(v_pool) || !cpu(block_tables) || !cpu(seq_lens)) return false;
  if (q.dim() != 3 || !kv_dtype(q) || !kv_dtype(k_pool) || k_pool.dim() != 4 ||
      v_pool.scalar_type() != k_pool.scalar_type() || v_pool.sizes() != k_pool.sizes())
    return false;
  if (!k_pool.is_contiguous() || !v_pool.is_contiguous()) return false;  // no copies of a pool
  const int64_t B = q.size(0);
  return k_pool.size(3) == q.size(2) && k_pool.size(2) > 0 && q.size(1) % k_pool.size(2) == 0 &&
         block_tables.scalar_type() == torch::kInt32 && block_tables.dim() == 2 &&
         block_tables.size(0) == B && seq_lens.scalar_type() == torch::kInt32 &&
         seq_lens.numel() == B && cpu::HasAvx2Fma();
}

torch::Tensor PagedDecodeCpu(const torch::Tensor& q, const torch::Tensor& k_pool,
                             const torch::Tensor& v_pool, const torch::Tensor& block_tables,
                             const torch::Tensor& seq_lens, double scale) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_pool.size(2);
  const int64_t bs = k_pool.size(1), max_blocks = block_tables.size(1);
  const auto tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  const int32_t* len = lens.data_ptr<int32_t>();
  CheckTables(tables.data_ptr<int32_t>(), len, B, max_blocks, bs, k_pool.size(0));
  // Scaled once here, not once per score.
  const auto qf = (q.to(torch::kFloat32) * scale).contiguous();
  const int64_t splits =
      (max_blocks * bs + kPagedDecodeCpuSplitTokens - 1) / kPagedDecodeCpuSplitTokens;
  auto f32 = qf.options();
  auto part_acc = torch::empty({B, Hq, splits, D}, f32);
  auto part_ml = torch::empty({B, Hq, splits, 2}, f32);
  auto out = torch::empty({B, Hq, D}, f32);
  const Problem pr{
      qf.data_ptr<float>(),       tables.data_ptr<int32_t>(), max_blocks, Hq, Hkv, D, splits,
      part_acc.data_ptr<float>(), part_ml.data_ptr<float>()};
  const auto tasks = MakeTasks(len, B);
  if (k_pool.scalar_type() == torch::kBFloat16)
    RunAll(pr, KvView<BF16>{k_pool.data_ptr<BF16>(), v_pool.data_ptr<BF16>(), bs, Hkv * D, D},
           tasks);
  else
    RunAll(pr, KvView<float>{k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), bs, Hkv * D, D},
           tasks);
  MergeSplits(pr, len, B, out.data_ptr<float>());
  return out.to(q.scalar_type());
}

}  // namespace lm
