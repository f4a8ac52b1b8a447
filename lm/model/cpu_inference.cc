#include "lm/model/cpu_inference.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include "lm/model/cpu_kernels.h"

namespace lm {
namespace {

// An expert with at most this many rows runs the streaming kernel (cpu::ExpertSwiGlu): too few
// rows for the library GEMM to amortise packing the weight. More rows take the library GEMM.
constexpr int64_t kKernelMaxRows = 32;

// Rows of one expert per task. Bounds the task's working set (about 1.5 MiB of activations at
// hidden 512) and splits busy experts, so threads finish together.
constexpr int64_t kRowsPerTask = 128;

// LM-head panels per parallel task: a few hundred KiB of weight each.
constexpr int64_t kPanelsPerTask = 16;

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

struct Task {
  int64_t expert, begin, end;  // indices into ExpertRows::pair
};

// Tasks of at most kRowsPerTask rows, largest first: handed out one at a time from an atomic
// counter, the threads then finish together (a static split of unevenly loaded experts left one
// thread waiting at the barrier).
std::vector<Task> MakeTasks(const ExpertRows& rows) {
  std::vector<Task> tasks;
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(rows.offset.size()); ++e) {
    for (int64_t b = rows.offset[e]; b < rows.offset[e + 1]; b += kRowsPerTask)
      tasks.push_back({e, b, std::min(b + kRowsPerTask, rows.offset[e + 1])});
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.end - a.begin > b.end - b.begin; });
  return tasks;
}

// Per-thread buffers of one task: its gathered rows, [gate | up], and its output rows.
struct TaskBuffers {
  torch::Tensor xs, gu, ys;
  void Reserve(int64_t m, int64_t H, int64_t I) {
    if (xs.defined() && xs.size(0) >= m) return;
    xs = torch::empty({m, H});
    gu = torch::empty({m, 2 * I});
    ys = torch::empty({m, H});
  }
};

// SwiGLU of expert e on the m gathered rows in b: y = (silu(x G^T) * (x U^T)) D^T.
void ExpertMlp(TaskBuffers& b, int64_t m, const torch::Tensor& gate_up, const torch::Tensor& down,
               int64_t e) {
  const int64_t H = gate_up.size(2), I = down.size(2);
  if (m <= kKernelMaxRows) {
    cpu::ExpertSwiGlu(b.xs.data_ptr<float>(), m, H, gate_up.data_ptr<float>() + e * 2 * I * H,
                      down.data_ptr<float>() + e * H * I, I, b.gu.data_ptr<float>(),
                      b.ys.data_ptr<float>());
    return;
  }
  auto gu = b.gu.narrow(0, 0, m), ys = b.ys.narrow(0, 0, m);
  torch::mm_out(gu, b.xs.narrow(0, 0, m), gate_up[e].t());
  auto act = gu.narrow(1, 0, I);
  torch::silu_(act).mul_(gu.narrow(1, I, I));
  torch::mm_out(ys, act, down[e].t());
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

// The Fortran BLAS sgemm of the library LibTorch links (MKL in the x86 wheels). Weak: where a
// build does not export it, the delta rule keeps its library-op path (UseCpuInferenceDeltaRule).
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c, const int* ldc)
    __attribute__((weak));

// Row-major C = alpha op(A) op(B) + beta C, with op(A) [m, k] and op(B) [k, n]; `ta` means A is
// stored as [k, m], `tb` that B is stored as [n, k]. BLAS is column-major, so this asks it for
// C^T = op(B)^T op(A)^T. Inside a parallel region the library runs on the calling thread. Called
// directly because the small products of one chunk are a few microseconds each, about what a
// tensor op costs in dispatch alone.
void Gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const char transa = tb ? 'T' : 'N', transb = ta ? 'T' : 'N';
  const int M = static_cast<int>(n), N = static_cast<int>(m), K = static_cast<int>(k);
  const int LDA = static_cast<int>(ldb), LDB = static_cast<int>(lda), LDC = static_cast<int>(ldc);
  sgemm_(&transa, &transb, &M, &N, &K, &alpha, b, &LDA, a, &LDB, &beta, c, &LDC);
}

// One (document, value head) of the delta rule: where its rows are and how far apart.
struct DeltaRuleHead {
  const float *q, *k, *v, *g, *beta;  // first row of the document for this head
  float* o;
  int64_t len;                             // tokens in the document
  int64_t qk_stride, v_stride, gb_stride;  // floats between consecutive tokens
};

// The per-thread buffers of the chunked rule for chunk size C, key dim dk, value dim dv.
struct DeltaRuleScratch {
  DeltaRuleScratch(int64_t C, int64_t dk, int64_t dv) : C(C), dk(dk), dv(dv) {
    float** parts[] = {&S, &G, &D, &A, &Tinv, &R, &UW, &QG, &KD, &Attn, &VNew};
    const int64_t sizes[] = {dk * dv,       C,      C * C,  C * C, C * C, C * (dv + dk),
                             C * (dv + dk), C * dk, C * dk, C * C, C * dv};
    int64_t total = 0;
    for (int64_t n : sizes) total += (n + 15) / 16 * 16;  // each part 64-byte aligned
    buf_ = torch::empty({total});                         // 64-byte aligned
    float* p = buf_.data_ptr<float>();
    for (int i = 0; i < 11; ++i) {
      *parts[i] = p;
      p += (sizes[i] + 15) / 16 * 16;
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

// The chunked delta rule of lm/model/qwen3_next.h for one (document, head), chunk by chunk: the
// same algebra as GatedDeltaRuleChunked, but its matrices stay in this thread's cache and a
// short last chunk is computed at its length rather than padded.
void RunDeltaRuleHead(const DeltaRuleHead& h, DeltaRuleScratch& s) {
  const int64_t C = s.C, dk = s.dk, dv = s.dv, ldr = dv + dk;
  float *S = s.S, *G = s.G, *D = s.D, *A = s.A, *Tinv = s.Tinv, *R = s.R, *UW = s.UW, *QG = s.QG,
        *KD = s.KD, *Attn = s.Attn, *VNew = s.VNew;
  for (int64_t c0 = 0; c0 < h.len; c0 += C) {
    const int64_t L = std::min(C, h.len - c0);
    const float* q = h.q + c0 * h.qk_stride;
    const float* k = h.k + c0 * h.qk_stride;
    const float* v = h.v + c0 * h.v_stride;
    float* o = h.o + c0 * h.v_stride;
    float acc = 0.0f;
    for (int64_t i = 0; i < L; ++i) G[i] = acc += h.g[(c0 + i) * h.gb_stride];
    for (int64_t i = 0; i < L; ++i)
      for (int64_t j = 0; j <= i; ++j) D[i * C + j] = std::exp(G[i] - G[j]);
    // R = [beta V | beta exp(G) K]; (beta K) is kept in R's second half first, for A.
    for (int64_t i = 0; i < L; ++i) {
      const float b = h.beta[(c0 + i) * h.gb_stride], eg = std::exp(G[i]);
      float* r = R + i * ldr;
      for (int64_t j = 0; j < dv; ++j) r[j] = b * v[i * h.v_stride + j];
      for (int64_t j = 0; j < dk; ++j) r[dv + j] = b * k[i * h.qk_stride + j];
      for (int64_t j = 0; j < dk; ++j) QG[i * dk + j] = eg * q[i * h.qk_stride + j];
    }
    Gemm(false, true, L, L, dk, 1.0f, R + dv, ldr, k, h.qk_stride, 0.0f, A, C);  // (beta K) K^T
    for (int64_t i = 0; i < L; ++i) {
      const float eg = std::exp(G[i]);
      for (int64_t j = 0; j < dk; ++j) R[i * ldr + dv + j] *= eg;
    }
    // Tinv = (I + L)^-1 for L the strict lower triangle of A * D, by forward substitution:
    // row i of Tinv is e_i - sum_{m < i} L_im (row m of Tinv).
    for (int64_t i = 0; i < L; ++i) {
      float* ti = Tinv + i * C;
      std::fill_n(ti, L, 0.0f);
      ti[i] = 1.0f;
      for (int64_t m = 0; m < i; ++m) {
        const float lim = A[i * C + m] * D[i * C + m];
        const float* tm = Tinv + m * C;
        for (int64_t j = 0; j <= m; ++j) ti[j] -= lim * tm[j];
      }
    }
    Gemm(false, false, L, ldr, L, 1.0f, Tinv, C, R, ldr, 0.0f, UW, ldr);  // [U | W]
    Gemm(false, true, L, L, dk, 1.0f, q, h.qk_stride, k, h.qk_stride, 0.0f, Attn, C);
    for (int64_t i = 0; i < L; ++i) {
      for (int64_t j = 0; j <= i; ++j) Attn[i * C + j] *= D[i * C + j];
      std::fill_n(Attn + i * C + i + 1, L - i - 1, 0.0f);
    }
    for (int64_t i = 0; i < L; ++i)
      for (int64_t j = 0; j < dv; ++j) VNew[i * dv + j] = UW[i * ldr + j];
    const bool first = c0 == 0;  // the state is zero: it reads nothing
    if (!first) Gemm(false, false, L, dv, dk, -1.0f, UW + dv, ldr, S, dv, 1.0f, VNew, dv);
    // O = exp(G) Q S + Attn V'
    if (first) {
      for (int64_t i = 0; i < L; ++i) std::fill_n(o + i * h.v_stride, dv, 0.0f);
    } else {
      Gemm(false, false, L, dv, dk, 1.0f, QG, dk, S, dv, 0.0f, o, h.v_stride);
    }
    Gemm(false, false, L, dv, L, 1.0f, Attn, C, VNew, dv, 1.0f, o, h.v_stride);
    // S = exp(G_last) S + (exp(G_last - G) K)^T V'
    const float g_last = G[L - 1];
    for (int64_t i = 0; i < L; ++i) {
      const float e = std::exp(g_last - G[i]);
      for (int64_t j = 0; j < dk; ++j) KD[i * dk + j] = e * k[i * h.qk_stride + j];
    }
    Gemm(true, false, dk, dv, L, 1.0f, KD, dk, VNew, dv, first ? 0.0f : std::exp(g_last), S, dv);
  }
}
}  // namespace

bool UseCpuInferenceExperts(const torch::Tensor& x, const torch::Tensor& weights,
                            const torch::Tensor& gate_up, const torch::Tensor& down) {
  const bool needs_grad =
      torch::GradMode::is_enabled() && (x.requires_grad() || weights.requires_grad() ||
                                        gate_up.requires_grad() || down.requires_grad());
  auto fp32_cpu = [](const torch::Tensor& t) {
    return t.is_cpu() && t.scalar_type() == torch::kFloat32;
  };
  return !needs_grad && fp32_cpu(x) && fp32_cpu(weights) && fp32_cpu(gate_up) && fp32_cpu(down) &&
         gate_up.is_contiguous() && down.is_contiguous() && x.size(1) % 8 == 0 &&
         down.size(2) % 8 == 0 && cpu::HasAvx2Fma();
}

torch::Tensor MoeExpertsInferenceCpu(const torch::Tensor& x_in, const torch::Tensor& ids_in,
                                     const torch::Tensor& weights, const torch::Tensor& gate_up,
                                     const torch::Tensor& down) {
  const auto x = x_in.contiguous();
  const auto ids = ids_in.to(torch::kInt64).contiguous();
  const int64_t T = x.size(0), k = ids.size(1), H = x.size(1), I = down.size(2);
  const ExpertRows rows = GroupByExpert(ids, gate_up.size(0));
  const std::vector<Task> tasks = MakeTasks(rows);
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  std::atomic<int64_t> next{0};

  auto y = torch::empty({T * k, H}, x.options());  // one output row per (token, slot) pair
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // One task per thread at a time; nested library calls inside run on their thread alone.
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tasks), 1,
                   [&](int64_t, int64_t) {
                     torch::NoGradGuard no_grad;  // grad mode is per thread
                     TaskBuffers b;
                     b.Reserve(kRowsPerTask, H, I);
                     for (int64_t i = next++; i < num_tasks; i = next++) {
                       const Task& t = tasks[i];
                       const int64_t m = t.end - t.begin;
                       const int64_t* pair = rows.pair.data() + t.begin;
                       float* xs = b.xs.data_ptr<float>();
                       for (int64_t r = 0; r < m; ++r)
                         std::copy_n(xp + (pair[r] / k) * H, H, xs + r * H);
                       ExpertMlp(b, m, gate_up, down, t.expert);
                       const float* ys = b.ys.data_ptr<float>();
                       for (int64_t r = 0; r < m; ++r) std::copy_n(ys + r * H, H, yp + pair[r] * H);
                     }
                   });
  return SumSlots(y, weights);
}

bool UseCpuInferenceDeltaRule(const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& v, const torch::Tensor& g,
                              const torch::Tensor& beta) {
  const bool needs_grad = torch::GradMode::is_enabled() &&
                          (q.requires_grad() || k.requires_grad() || v.requires_grad() ||
                           g.requires_grad() || beta.requires_grad());
  for (const auto* t : {&q, &k, &v, &g, &beta}) {
    if (!t->is_cpu() || t->scalar_type() != torch::kFloat32) return false;
  }
  return !needs_grad && sgemm_ != nullptr;
}

torch::Tensor GatedDeltaRuleInferenceCpu(const torch::Tensor& q_in, const torch::Tensor& k_in,
                                         const torch::Tensor& v_in, const torch::Tensor& g_in,
                                         const torch::Tensor& beta_in,
                                         const std::vector<int64_t>& cu_seqlens, int64_t chunk) {
  const auto q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const auto g = g_in.contiguous(), beta = beta_in.contiguous();
  const int64_t T = v.size(0), Hv = v.size(1), dv = v.size(2), Hk = k.size(1), dk = k.size(2);
  TORCH_CHECK(
      q.sizes() == k.sizes() && Hv % Hk == 0 && g.size(0) == T && g.size(1) == Hv &&
          beta.sizes() == g.sizes() && k.size(0) == T,
      "delta rule: q, k [T, Hk, dk], v [T, Hv, dv], g, beta [T, Hv] with Hv % Hk == 0; got ",
      q.sizes(), ", ", k.sizes(), ", ", v.sizes(), ", ", g.sizes(), ", ", beta.sizes());
  TORCH_CHECK(!cu_seqlens.empty() && cu_seqlens.front() == 0 && cu_seqlens.back() == T,
              "delta rule: cu_seqlens must run from 0 to ", T);
  auto o = torch::empty_like(v);
  // Tasks are (document, value head) pairs, longest documents first: they finish together.
  std::vector<std::pair<int64_t, int64_t>> tasks;
  for (int64_t b = 0; b + 1 < static_cast<int64_t>(cu_seqlens.size()); ++b) {
    if (cu_seqlens[b + 1] > cu_seqlens[b])
      for (int64_t h = 0; h < Hv; ++h) tasks.emplace_back(b, h);
  }
  auto len = [&](int64_t b) { return cu_seqlens[b + 1] - cu_seqlens[b]; };
  std::stable_sort(tasks.begin(), tasks.end(),
                   [&](const auto& x, const auto& y) { return len(x.first) > len(y.first); });
  const int64_t num_tasks = static_cast<int64_t>(tasks.size()), r = Hv / Hk;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tasks), 1,
                   [&](int64_t, int64_t) {
                     DeltaRuleScratch scratch(chunk, dk, dv);
                     for (int64_t i = next++; i < num_tasks; i = next++) {
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
                     }
                   });
  return o;
}

bool UseCpuLogSumExpRows(const torch::Tensor& logits) {
  return logits.is_cpu() && logits.scalar_type() == torch::kFloat32 && logits.dim() == 2 &&
         logits.stride(1) == 1 && cpu::HasAvx2Fma();
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

std::optional<PackedLinear> PackedLinear::Pack(const torch::Tensor& weight) {
  if (!weight.is_cpu() || weight.scalar_type() != torch::kFloat32 || weight.dim() != 2 ||
      !cpu::HasAvx2Fma()) {
    return std::nullopt;
  }
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
