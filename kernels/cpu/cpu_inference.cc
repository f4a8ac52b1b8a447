#include "kernels/cpu/cpu_inference.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/parallel_tasks.h"
#include "lm/model/batch_invariant.h"

// The Fortran BLAS sgemm of the library LibTorch links (MKL in the x86 wheels). Weak: where a
// build does not export it, the paths that need it are not taken (HasBlas()).
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c, const int* ldc)
    __attribute__((weak));
// MKL's thread count for the calling thread only (its Fortran interface, like sgemm_: the argument
// by address); returns the previous one (0: the global setting).
extern "C" int mkl_set_num_threads_local_(const int* nt) __attribute__((weak));

namespace lm {
namespace {

// ---- shared ----

bool HasBlas() {
  return sgemm_ != nullptr;
}

// Row-major C = alpha op(A) op(B) + beta C, with op(A) [m, k] and op(B) [k, n]; `ta` means A is
// stored as [k, m], `tb` that B is stored as [n, k]. BLAS is column-major, so this asks it for
// C^T = op(B)^T op(A)^T. Called directly rather than through a tensor op: a chunk's products take
// a few microseconds, about what an op costs in dispatch alone. The library runs on the calling
// thread, also outside a parallel region: a multi-threaded MKL product can round differently from
// a single-threaded one, and the kernels' results must not depend on the thread count (the
// parallelism is the kernels' own, over tiles and rows).
void Gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const char transa = tb ? 'T' : 'N', transb = ta ? 'T' : 'N';
  const int M = static_cast<int>(n), N = static_cast<int>(m), K = static_cast<int>(k);
  const int LDA = static_cast<int>(ldb), LDB = static_cast<int>(lda), LDC = static_cast<int>(ldc);
  const int one = 1;
  const int previous = mkl_set_num_threads_local_ ? mkl_set_num_threads_local_(&one) : 0;
  sgemm_(&transa, &transb, &M, &N, &K, &alpha, b, &LDA, a, &LDB, &beta, c, &LDC);
  if (mkl_set_num_threads_local_) mkl_set_num_threads_local_(&previous);
}

// x [M, K] in a fresh zero-padded [ceil(M / rows) * rows, K] fp32 buffer: whole blocks of
// `rows` rows, each at the same alignment (LibTorch allocates 64-byte aligned).
torch::Tensor PaddedRows(const torch::Tensor& x, int64_t rows) {
  const int64_t M = x.size(0);
  auto padded = torch::zeros({std::max<int64_t>(1, (M + rows - 1) / rows) * rows, x.size(1)},
                             x.options().dtype(torch::kFloat32));
  padded.narrow(0, 0, M).copy_(x);
  return padded;
}

bool NeedsGrad(std::initializer_list<const torch::Tensor*> ts) {
  if (!torch::GradMode::is_enabled()) return false;
  return std::any_of(ts.begin(), ts.end(),
                     [](const torch::Tensor* t) { return t->requires_grad(); });
}

bool AllFp32Cpu(std::initializer_list<const torch::Tensor*> ts) {
  return std::all_of(ts.begin(), ts.end(), [](const torch::Tensor* t) {
    return t->is_cpu() && t->scalar_type() == torch::kFloat32;
  });
}

// ---- MoE experts ----

// An expert task with at most this many rows runs the streaming kernel (cpu::ExpertSwiGlu): too
// few rows for the library GEMM to amortise packing the weight. More rows take the library GEMM.
constexpr int64_t kKernelMaxRows = 32;

// Rows of one expert per task: bounds a task's buffers (1.5 MiB at hidden 512) and splits busy
// experts, so that no single task holds the threads up at the end.
constexpr int64_t kRowsPerTask = 128;
// Batch-invariant tasks are kInvariantRows rows: they must fit the buffers and take the GEMM.
static_assert(kInvariantRows > kKernelMaxRows && kInvariantRows <= kRowsPerTask);

// The (token, slot) pairs routed to each expert, expert-major and in token order within one
// expert: pairs of expert e are pair[offset[e] .. offset[e + 1]).
struct ExpertRows {
  std::vector<int64_t> offset, pair;
};

ExpertRows GroupByExpert(const torch::Tensor& ids, int64_t E) {
  const int64_t n = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  ExpertRows r;
  r.offset.assign(E + 1, 0);
  for (int64_t p = 0; p < n; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < E, "expert id ", id[p], " out of range [0, ", E, ")");
    ++r.offset[id[p] + 1];
  }
  for (int64_t e = 0; e < E; ++e) r.offset[e + 1] += r.offset[e];
  r.pair.resize(n);
  std::vector<int64_t> fill(r.offset.begin(), r.offset.end() - 1);
  for (int64_t p = 0; p < n; ++p) r.pair[fill[id[p]]++] = p;
  return r;
}

struct ExpertTask {
  int64_t expert, begin, end;  // indices into ExpertRows::pair
};

// Tasks of at most `per_task` rows, largest first.
std::vector<ExpertTask> MakeExpertTasks(const ExpertRows& rows, int64_t per_task) {
  std::vector<ExpertTask> tasks;
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(rows.offset.size()); ++e) {
    for (int64_t b = rows.offset[e]; b < rows.offset[e + 1]; b += per_task)
      tasks.push_back({e, b, std::min(b + per_task, rows.offset[e + 1])});
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const ExpertTask& a, const ExpertTask& b) {
    return a.end - a.begin > b.end - b.begin;
  });
  return tasks;
}

// One thread's buffers: a task's gathered rows, their [gate | up] and their outputs. In one
// LibTorch allocation (64-byte aligned, each part too): the library's products then see the same
// alignment in every task and every call, which batch-invariant results need.
struct ExpertBuffers {
  ExpertBuffers(int64_t H, int64_t I)
      : buf_(torch::empty({Padded(kRowsPerTask * H) * 2 + Padded(kRowsPerTask * 2 * I)})) {
    xs = buf_.data_ptr<float>();
    ys = xs + Padded(kRowsPerTask * H);
    gu = ys + Padded(kRowsPerTask * H);
  }
  float *xs, *ys, *gu;

 private:
  static int64_t Padded(int64_t n) { return (n + 15) / 16 * 16; }
  torch::Tensor buf_;
};

// The SwiGLU MLP of one expert on m rows: y = (silu(x G^T) * (x U^T)) D^T, with the expert's
// gate_up [2I, H] and down [H, I].
void ExpertMlp(const float* x, int64_t m, int64_t H, const float* gate_up, const float* down,
               int64_t I, float* gu, float* y) {
  if (m <= kKernelMaxRows) return cpu::ExpertSwiGlu(x, m, H, gate_up, down, I, gu, y);
  Gemm(false, true, m, 2 * I, H, 1.0f, x, H, gate_up, H, 0.0f, gu, 2 * I);
  cpu::SiluMulInPlace(gu, m, I);
  Gemm(false, true, m, H, I, 1.0f, gu, 2 * I, down, I, 0.0f, y, H);
}

// out[t] = sum_s weights[t, s] * y[t * k + s], the slots added in order: the result does not
// depend on which thread computed which expert.
torch::Tensor SumSlots(const torch::Tensor& y, const torch::Tensor& weights) {
  const int64_t T = weights.size(0), k = weights.size(1), H = y.size(1);
  auto out = torch::empty({T, H}, y.options());
  const auto w = weights.to(torch::kFloat32).contiguous();
  const float* wp = w.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* o = op + t * H;
      const float* src = yp + t * k * H;
      for (int64_t h = 0; h < H; ++h) o[h] = wp[t * k] * src[h];
      for (int64_t s = 1; s < k; ++s) {
        const float ws = wp[t * k + s];
        for (int64_t h = 0; h < H; ++h) o[h] += ws * src[s * H + h];
      }
    }
  });
  return out;
}

// ---- gated delta rule ----

// One (document, value head) of the rule: its first row in each input and the floats between
// consecutive tokens.
struct DeltaRuleHead {
  const float *q, *k, *v, *g, *beta;
  float* o;
  int64_t len;                             // tokens in the document
  int64_t qk_stride, v_stride, gb_stride;  // q/k rows, v/o rows, g/beta entries
};

// One thread's matrices of the chunked rule, for chunk size C, key dim dk, value dim dv.
struct DeltaRuleScratch {
  DeltaRuleScratch(int64_t C, int64_t dk, int64_t dv) : C(C), dk(dk), dv(dv) {
    float** parts[] = {&S, &G, &D, &A, &Tinv, &R, &UW, &QG, &KD, &Attn, &VNew};
    const int64_t sizes[] = {dk * dv,       C,      C * C,  C * C, C * C, C * (dv + dk),
                             C * (dv + dk), C * dk, C * dk, C * C, C * dv};
    auto padded = [](int64_t n) { return (n + 15) / 16 * 16; };  // each part 64-byte aligned
    int64_t total = 0;
    for (int64_t n : sizes) total += padded(n);
    buf_ = torch::empty({total});  // 64-byte aligned itself
    float* p = buf_.data_ptr<float>();
    for (size_t i = 0; i < std::size(parts); ++i) {
      *parts[i] = p;
      p += padded(sizes[i]);
    }
  }
  DeltaRuleScratch(const DeltaRuleScratch&) = delete;
  DeltaRuleScratch& operator=(const DeltaRuleScratch&) = delete;

  const int64_t C, dk, dv;
  float* S;     // [dk, dv] the state
  float* G;     // [C] cumulative log decay within the chunk
  float* D;     // [C, C] exp(G_i - G_j), lower triangle
  float* A;     // [C, C] (beta K) K^T
  float* Tinv;  // [C, C] (I + strict_lower(A * D))^-1
  float* R;     // [C, dv + dk] [beta V | beta exp(G) K]
  float* UW;    // [C, dv + dk] [U | W] = Tinv R
  float* QG;    // [C, dk] exp(G) Q
  float* KD;    // [C, dk] exp(G_last - G) K
  float* Attn;  // [C, C] (Q K^T) * D, causal
  float* VNew;  // [C, dv] U - W S

 private:
  torch::Tensor buf_;
};

// The state-free terms of the L tokens from c0 (lm/model/gated_deltanet.h): D, U and W by the UT
// transform, the causal (Q K^T) * D, exp(G) Q and exp(G_last - G) K.
void IntraChunk(const DeltaRuleHead& h, int64_t c0, int64_t L, DeltaRuleScratch& s) {
  const int64_t C = s.C, dk = s.dk, dv = s.dv, ldr = dv + dk;
  const float* q = h.q + c0 * h.qk_stride;
  const float* k = h.k + c0 * h.qk_stride;
  const float* v = h.v + c0 * h.v_stride;
  float acc = 0.0f;
  for (int64_t i = 0; i < L; ++i) s.G[i] = acc += h.g[(c0 + i) * h.gb_stride];
  for (int64_t i = 0; i < L; ++i)
    for (int64_t j = 0; j <= i; ++j) s.D[i * C + j] = std::exp(s.G[i] - s.G[j]);
  // R = [beta V | beta K]; the second half gets its exp(G) after it served (beta K) K^T.
  for (int64_t i = 0; i < L; ++i) {
    const float b = h.beta[(c0 + i) * h.gb_stride];
    float* r = s.R + i * ldr;
    for (int64_t j = 0; j < dv; ++j) r[j] = b * v[i * h.v_stride + j];
    for (int64_t j = 0; j < dk; ++j) r[dv + j] = b * k[i * h.qk_stride + j];
  }
  Gemm(false, true, L, L, dk, 1.0f, s.R + dv, ldr, k, h.qk_stride, 0.0f, s.A, C);
  const float g_last = s.G[L - 1];
  for (int64_t i = 0; i < L; ++i) {
    const float eg = std::exp(s.G[i]), ed = std::exp(g_last - s.G[i]);
    for (int64_t j = 0; j < dk; ++j) {
      s.R[i * ldr + dv + j] *= eg;
      s.QG[i * dk + j] = eg * q[i * h.qk_stride + j];
      s.KD[i * dk + j] = ed * k[i * h.qk_stride + j];
    }
  }
  // Tinv = (I + L)^-1 for L the strict lower triangle of A * D, by forward substitution:
  // row i of Tinv is e_i - sum_{m < i} L_im (row m of Tinv).
  for (int64_t i = 0; i < L; ++i) {
    float* ti = s.Tinv + i * C;
    std::fill_n(ti, L, 0.0f);
    ti[i] = 1.0f;
    for (int64_t m = 0; m < i; ++m) {
      const float lim = s.A[i * C + m] * s.D[i * C + m];
      const float* tm = s.Tinv + m * C;
      for (int64_t j = 0; j <= m; ++j) ti[j] -= lim * tm[j];
    }
  }
  Gemm(false, false, L, ldr, L, 1.0f, s.Tinv, C, s.R, ldr, 0.0f, s.UW, ldr);  // [U | W]
  Gemm(false, true, L, L, dk, 1.0f, q, h.qk_stride, k, h.qk_stride, 0.0f, s.Attn, C);
  for (int64_t i = 0; i < L; ++i) {
    for (int64_t j = 0; j <= i; ++j) s.Attn[i * C + j] *= s.D[i * C + j];
    std::fill_n(s.Attn + i * C + i + 1, L - i - 1, 0.0f);
  }
}

// The scan step of the chunk at c0 against the state S at its start (zero when `first`):
//   V' = U - W S,  O = exp(G) Q S + Attn V',  S = exp(G_last) S + (exp(G_last - G) K)^T V'.
void AdvanceChunk(const DeltaRuleHead& h, int64_t c0, int64_t L, bool first, DeltaRuleScratch& s) {
  const int64_t C = s.C, dk = s.dk, dv = s.dv, ldr = dv + dk;
  float* o = h.o + c0 * h.v_stride;
  for (int64_t i = 0; i < L; ++i) std::copy_n(s.UW + i * ldr, dv, s.VNew + i * dv);
  if (first) {
    for (int64_t i = 0; i < L; ++i) std::fill_n(o + i * h.v_stride, dv, 0.0f);
  } else {
    Gemm(false, false, L, dv, dk, -1.0f, s.UW + dv, ldr, s.S, dv, 1.0f, s.VNew, dv);
    Gemm(false, false, L, dv, dk, 1.0f, s.QG, dk, s.S, dv, 0.0f, o, h.v_stride);
  }
  Gemm(false, false, L, dv, L, 1.0f, s.Attn, C, s.VNew, dv, 1.0f, o, h.v_stride);
  const float decay = first ? 0.0f : std::exp(s.G[L - 1]);
  Gemm(true, false, dk, dv, L, 1.0f, s.KD, dk, s.VNew, dv, decay, s.S, dv);
}

// The chunked rule for one (document, head), chunk by chunk: GatedDeltaRuleChunked's algebra,
// with the chunk's matrices and the state in this thread's cache, and a short last chunk computed
// at its length rather than padded.
void RunDeltaRuleHead(const DeltaRuleHead& h, DeltaRuleScratch& s) {
  for (int64_t c0 = 0; c0 < h.len; c0 += s.C) {
    const int64_t L = std::min(s.C, h.len - c0);
    IntraChunk(h, c0, L, s);
    AdvanceChunk(h, c0, L, /*first=*/c0 == 0, s);
  }
}

// ---- LM head ----

// The scoring LM head's tiles: kVocabPerTask weight rows per task (1 MiB at hidden 512, kept in
// cache while every block of hidden rows passes), kRowsPerProduct hidden rows per product (its
// 512 KiB block of logits is still in the core's L2 when the log-sum-exp reads it). Neighbouring
// sizes (256-1024 x 64-256) measured the same within the machine's noise.
constexpr int64_t kVocabPerTask = 512;
constexpr int64_t kRowsPerProduct = 256;

// LM-head panels per parallel task of PackedLinear: a few hundred KiB of weight each.
constexpr int64_t kPanelsPerTask = 16;

}  // namespace

// ---- MoE experts ----

bool UseCpuInferenceExperts(const torch::Tensor& x, const torch::Tensor& weights,
                            const torch::Tensor& gate_up, const torch::Tensor& down) {
  return !NeedsGrad({&x, &weights, &gate_up, &down}) &&
         AllFp32Cpu({&x, &weights, &gate_up, &down}) && gate_up.is_contiguous() &&
         down.is_contiguous() && x.size(1) % 8 == 0 && down.size(2) % 8 == 0 && cpu::HasAvx2Fma() &&
         HasBlas();
}

torch::Tensor MoeExpertsInferenceCpu(const torch::Tensor& x_in, const torch::Tensor& ids_in,
                                     const torch::Tensor& weights, const torch::Tensor& gate_up,
                                     const torch::Tensor& down) {
  const auto x = x_in.contiguous();
  const auto ids = ids_in.to(torch::kInt64).contiguous();
  const int64_t T = x.size(0), k = ids.size(1), H = x.size(1), I = down.size(2);
  const ExpertRows rows = GroupByExpert(ids, gate_up.size(0));
  // Batch-invariant: every task is kInvariantRows rows, padded with zeros, through the library
  // GEMM, so a row's products have one shape whatever number of rows its expert got.
  const bool invariant = BatchInvariant();
  const int64_t per_task = invariant ? kInvariantRows : kRowsPerTask;
  const std::vector<ExpertTask> tasks = MakeExpertTasks(rows, per_task);

  auto y = torch::empty({T * k, H}, x.options());  // one output row per (token, slot) pair
  const float* xp = x.data_ptr<float>();
  const float* gup = gate_up.data_ptr<float>();
  const float* dp = down.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  ParallelTasks(
      static_cast<int64_t>(tasks.size()), [&] { return ExpertBuffers(H, I); },
      [&](int64_t i, ExpertBuffers& b) {
        const ExpertTask& t = tasks[i];
        const int64_t m = t.end - t.begin;
        const int64_t* pair = rows.pair.data() + t.begin;
        for (int64_t r = 0; r < m; ++r) std::copy_n(xp + (pair[r] / k) * H, H, b.xs + r * H);
        const int64_t rows_run = invariant ? per_task : m;
        std::fill(b.xs + m * H, b.xs + rows_run * H, 0.0f);
        ExpertMlp(b.xs, rows_run, H, gup + t.expert * 2 * I * H, dp + t.expert * H * I, I, b.gu,
                  b.ys);
        for (int64_t r = 0; r < m; ++r) std::copy_n(b.ys + r * H, H, yp + pair[r] * H);
      });
  return SumSlots(y, weights);
}

// ---- gated delta rule ----

bool UseCpuInferenceDeltaRule(const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& v, const torch::Tensor& g,
                              const torch::Tensor& beta) {
  return !NeedsGrad({&q, &k, &v, &g, &beta}) && AllFp32Cpu({&q, &k, &v, &g, &beta}) && HasBlas();
}

torch::Tensor GatedDeltaRuleInferenceCpu(const torch::Tensor& q_in, const torch::Tensor& k_in,
                                         const torch::Tensor& v_in, const torch::Tensor& g_in,
                                         const torch::Tensor& beta_in,
                                         const std::vector<int64_t>& cu_seqlens, int64_t chunk,
                                         torch::Tensor* final_state) {
  const auto q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const auto g = g_in.contiguous(), beta = beta_in.contiguous();
  TORCH_CHECK(q.dim() == 3 && v.dim() == 3 && g.dim() == 2 && q.sizes() == k.sizes() &&
                  k.size(0) == v.size(0) && v.size(1) % k.size(1) == 0 && g.size(0) == v.size(0) &&
                  g.size(1) == v.size(1) && beta.sizes() == g.sizes(),
              "delta rule: expected q, k [T, Hk, dk], v [T, Hv, dv] with Hv a multiple of Hk, and "
              "g, beta [T, Hv]; got q ",
              q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), ", g ", g.sizes(), ", beta ",
              beta.sizes());
  const int64_t T = v.size(0), Hv = v.size(1), dv = v.size(2), Hk = k.size(1), dk = k.size(2);
  TORCH_CHECK(!cu_seqlens.empty() && cu_seqlens.front() == 0 && cu_seqlens.back() == T,
              "delta rule: cu_seqlens must run from 0 to ", T);
  auto o = torch::empty_like(v);
  const int64_t B = static_cast<int64_t>(cu_seqlens.size()) - 1;
  if (final_state) *final_state = torch::zeros({B, Hv, dk, dv}, v.options());
  // Tasks are (document, value head) pairs, longest documents first.
  auto len = [&](int64_t b) { return cu_seqlens[b + 1] - cu_seqlens[b]; };
  std::vector<std::pair<int64_t, int64_t>> tasks;
  for (int64_t b = 0; b + 1 < static_cast<int64_t>(cu_seqlens.size()); ++b) {
    if (len(b) > 0)
      for (int64_t h = 0; h < Hv; ++h) tasks.emplace_back(b, h);
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [&](const auto& x, const auto& y) { return len(x.first) > len(y.first); });
  const int64_t r = Hv / Hk;  // value head h reads key head h / r
  ParallelTasks(
      static_cast<int64_t>(tasks.size()), [&] { return DeltaRuleScratch(chunk, dk, dv); },
      [&](int64_t i, DeltaRuleScratch& scratch) {
        const auto [b, h] = tasks[i];
        const int64_t t0 = cu_seqlens[b];
        const DeltaRuleHead head{q.data_ptr<float>() + (t0 * Hk + h / r) * dk,
                                 k.data_ptr<float>() + (t0 * Hk + h / r) * dk,
                                 v.data_ptr<float>() + (t0 * Hv + h) * dv,
                                 g.data_ptr<float>() + t0 * Hv + h,
                                 beta.data_ptr<float>() + t0 * Hv + h,
                                 o.data_ptr<float>() + (t0 * Hv + h) * dv,
                                 len(b),
                                 Hk * dk,
                                 Hv * dv,
                                 Hv};
        RunDeltaRuleHead(head, scratch);
        if (final_state)
          std::copy_n(scratch.S, dk * dv, final_state->data_ptr<float>() + (b * Hv + h) * dk * dv);
      });
  return o;
}

// ---- LM head ----

bool UseCpuLogSumExpRows(const torch::Tensor& logits) {
  return AllFp32Cpu({&logits}) && logits.dim() == 2 && logits.stride(1) == 1 && cpu::HasAvx2Fma();
}

torch::Tensor LogSumExpRowsCpu(const torch::Tensor& logits) {
  const int64_t n = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  auto out = torch::empty({n}, logits.options());
  const float* x = logits.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) o[r] = cpu::LogSumExp(x + r * ld, V);
  });
  return out;
}

bool UseCpuInferenceLogprobs(const torch::Tensor& hidden, const torch::Tensor& weight) {
  return !NeedsGrad({&hidden, &weight}) && AllFp32Cpu({&hidden, &weight}) && hidden.dim() == 2 &&
         weight.dim() == 2 && cpu::HasAvx2Fma() && HasBlas();
}

torch::Tensor TokenLogprobsInferenceCpu(const torch::Tensor& hidden_in,
                                        const torch::Tensor& weight_in,
                                        const torch::Tensor& targets_in, double temperature) {
  const auto hidden = hidden_in.contiguous(), weight = weight_in.contiguous();
  const auto targets = targets_in.to(torch::kInt64).contiguous();
  const int64_t N = hidden.size(0), H = hidden.size(1), V = weight.size(0);
  TORCH_CHECK(weight.size(1) == H && targets.dim() == 1 && targets.size(0) == N,
              "LM head log-probs: expected hidden [N, H], weight [V, H], targets [N]; got ",
              hidden.sizes(), ", ", weight.sizes(), ", ", targets.sizes());
  TORCH_CHECK(temperature > 0, "LM head log-probs: temperature must be positive, got ",
              temperature);
  const int64_t* target = targets.data_ptr<int64_t>();
  for (int64_t r = 0; r < N; ++r) {
    TORCH_CHECK(target[r] >= 0 && target[r] < V, "target id ", target[r], " out of range [0, ", V,
                ")");
  }
  // Each task: one vocabulary tile against every row, leaving the tile's log-sum-exp per row and
  // the target's logit where the tile holds it. The tiles' log-sum-exps are combined at the end.
  const int64_t tiles = (V + kVocabPerTask - 1) / kVocabPerTask;
  std::vector<float> tile_lse(N * tiles), target_logit(N);
  // Batch-invariant: the rows padded with zeros to whole kRowsPerProduct blocks in a fresh buffer,
  // so that every product has the same shape and alignment whichever rows it holds.
  const bool invariant = BatchInvariant();
  const torch::Tensor padded = invariant ? PaddedRows(hidden, kRowsPerProduct) : hidden;
  const float* h = padded.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float alpha = static_cast<float>(1.0 / temperature);
  ParallelTasks(
      tiles, [] { return torch::empty({kRowsPerProduct * kVocabPerTask}); },  // 64-byte aligned
      [&](int64_t t, torch::Tensor& block) {
        float* logits = block.data_ptr<float>();
        const int64_t v0 = t * kVocabPerTask, nv = std::min(kVocabPerTask, V - v0);
        for (int64_t r0 = 0; r0 < N; r0 += kRowsPerProduct) {
          const int64_t nr = std::min(kRowsPerProduct, N - r0);
          Gemm(false, true, invariant ? kRowsPerProduct : nr, nv, H, alpha, h + r0 * H, H,
               w + v0 * H, H, 0.0f, logits, nv);
          for (int64_t r = 0; r < nr; ++r) {
            const float* row = logits + r * nv;
            tile_lse[(r0 + r) * tiles + t] = cpu::LogSumExp(row, nv);
            const int64_t j = target[r0 + r] - v0;
            if (j >= 0 && j < nv) target_logit[r0 + r] = row[j];
          }
        }
      });
  auto out = torch::empty({N}, hidden.options());
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < N; ++r)
    o[r] = target_logit[r] - cpu::LogSumExp(tile_lse.data() + r * tiles, tiles);
  return out;
}

// ---- batch-invariant GEMM ----

bool UseCpuRowInvariantMatmul(const torch::Tensor& x, const torch::Tensor& w) {
  return !NeedsGrad({&x, &w}) && AllFp32Cpu({&x, &w}) && x.dim() == 2 && w.dim() == 2 &&
         x.size(1) == w.size(1) && HasBlas();
}

torch::Tensor RowInvariantMatmulCpu(const torch::Tensor& x, const torch::Tensor& w_in) {
  const auto w = w_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const torch::Tensor xp = PaddedRows(x, kInvariantRows);
  const int64_t row_blocks = xp.size(0) / kInvariantRows;
  const int64_t col_blocks = std::max<int64_t>(1, (N + kInvariantCols - 1) / kInvariantCols);
  auto out = torch::empty({M, N}, xp.options());
  const float* a = xp.data_ptr<float>();
  const float* b = w.data_ptr<float>();
  float* o = out.data_ptr<float>();
  // Each task one [kInvariantRows, K] x [K, <= kInvariantCols] product on one thread, into an
  // aligned tile of its own (ldc = the tile's width, whatever N), then its real rows copied out.
  ParallelTasks(
      row_blocks * col_blocks, [] { return torch::empty({kInvariantRows * kInvariantCols}); },
      [&](int64_t t, torch::Tensor& tile) {
        const int64_t r0 = (t / col_blocks) * kInvariantRows,
                      n0 = (t % col_blocks) * kInvariantCols;
        const int64_t nc = std::min(kInvariantCols, N - n0);
        if (nc <= 0) return;
        float* c = tile.data_ptr<float>();
        Gemm(false, true, kInvariantRows, nc, K, 1.0f, a + r0 * K, K, b + n0 * K, K, 0.0f, c, nc);
        for (int64_t r = 0; r < std::min(kInvariantRows, M - r0); ++r)
          std::copy_n(c + r * nc, nc, o + (r0 + r) * N + n0);
      });
  return out;
}

// ---- packed LM head for decode ----

std::optional<PackedLinear> PackedLinear::Pack(const torch::Tensor& weight) {
  if (!AllFp32Cpu({&weight}) || weight.dim() != 2 || !cpu::HasAvx2Fma()) return std::nullopt;
  const auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), panels = (N + cpu::kPanel - 1) / cpu::kPanel;
  auto packed = torch::empty({cpu::PackedPanelsFloats(N, K)}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, kPanelsPerTask,
                   [&](int64_t p0, int64_t p1) { cpu::PackPanels(src, N, K, p0, p1, dst); });
  return PackedLinear(std::move(packed), N, K);
}

torch::Tensor PackedLinear::operator()(const torch::Tensor& x_in) const {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == k_, "PackedLinear: expected [rows, ", k_,
              "] input, got ", x_in.sizes());
  const auto x = x_in.to(torch::kFloat32).contiguous();
  const int64_t m = x.size(0), panels = (n_ + cpu::kPanel - 1) / cpu::kPanel;
  auto out = torch::empty({m, n_}, x.options());
  const float* a = x.data_ptr<float>();
  const float* packed = packed_.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, panels, kPanelsPerTask, [&](int64_t p0, int64_t p1) {
    cpu::MatmulPackedPanels(a, k_, m, packed, n_, k_, p0, p1, o, n_);
  });
  return out;
}

}  // namespace lm
