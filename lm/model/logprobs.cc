#include "lm/model/logprobs.h"

#include <torch/torch.h>

#include "lm/model/batch_invariant.h"
#include "lm/model/fast_paths.h"
#include "lm/model/layers.h"
#include "lm/model/precision.h"

namespace lm {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// One chunk's logits [n, V] in fp32, written into rows [0, n) of `scratch` [chunk, V]. The scratch
// is allocated once per call and reused by every chunk: a fresh [chunk, V] buffer per chunk cost
// more in page faults than the log-softmax arithmetic.
torch::Tensor ChunkLogits(torch::Tensor& scratch, const torch::Tensor& h, const torch::Tensor& w,
                          double temperature) {
  auto logits = scratch.narrow(0, 0, h.size(0));
  if (h.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32) {
    MatmulWeightTOut(logits, h, w);
  } else {
    // A bf16 head (bf16-mixed training with fp32 hidden states, or a bf16 teacher / rollout):
    // fp32 logits from bf16 operands, the same arithmetic in every process (LogitsFp32).
    logits.copy_(LogitsFp32(h, w));
  }
  return temperature == 1.0 ? logits : logits.div_(temperature);
}

torch::Tensor Scratch(const torch::Tensor& hidden, const torch::Tensor& weight, int64_t chunk) {
  return torch::empty({std::min(chunk, hidden.size(0)), weight.size(0)},
                      hidden.options().dtype(torch::kFloat32));
}

// logsumexp of each row of `logits`, which it overwrites with exp(logits - max): three passes
// over the chunk and no temporaries of its size.
torch::Tensor LogsumexpInPlace(torch::Tensor& logits) {
  auto max = logits.amax(1, /*keepdim=*/true);
  return logits.sub_(max).exp_().sum(1).log_().add_(max.squeeze(1));
}

// log p(target) per row, chunked; saves only (hidden, weight, targets, logsumexp) for backward:
//   d logp_t / d logits = onehot(t) - softmax(logits)
class ChunkedTokenLogprob : public torch::autograd::Function<ChunkedTokenLogprob> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& hidden,
                               const torch::Tensor& weight, const torch::Tensor& targets,
                               double temperature, int64_t chunk) {
    const int64_t N = hidden.size(0);
    auto out = torch::empty({N}, hidden.options().dtype(torch::kFloat32));
    auto lse = torch::empty({N}, out.options());
    auto scratch = Scratch(hidden, weight, chunk);
    for (int64_t s = 0; s < N; s += chunk) {
      const int64_t n = std::min(chunk, N - s);
      auto logits = ChunkLogits(scratch, hidden.narrow(0, s, n), weight, temperature);
      auto target_logit = logits.gather(1, targets.narrow(0, s, n).unsqueeze(1)).squeeze(1);
      torch::Tensor l;
      if (BatchInvariant()) {
        l = InvariantLogSumExpRows(logits);
      } else if (const auto fast = FastPathsFor(logits.device().type()).logsumexp_rows) {
        l = fast(logits);
      }
      if (!l.defined()) l = LogsumexpInPlace(logits);
      lse.narrow(0, s, n).copy_(l);
      out.narrow(0, s, n).copy_(target_logit - l);
    }
    ctx->save_for_backward({hidden, weight, targets, lse});
    ctx->saved_data["temperature"] = temperature;
    ctx->saved_data["chunk"] = chunk;
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grad_outputs) {
    auto saved = ctx->get_saved_variables();
    const auto &hidden = saved[0], &weight = saved[1], &targets = saved[2], &lse = saved[3];
    const double temperature = ctx->saved_data["temperature"].toDouble();
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    auto g = grad_outputs[0];
    const int64_t N = hidden.size(0);
    auto dhidden = torch::empty_like(hidden);
    auto dweight = torch::zeros(weight.sizes(), weight.options().dtype(torch::kFloat32));
    auto scratch = Scratch(hidden, weight, chunk);
    for (int64_t s = 0; s < N; s += chunk) {
      const int64_t n = std::min(chunk, N - s);
      auto h = hidden.narrow(0, s, n);
      auto logits = ChunkLogits(scratch, h, weight, temperature);
      auto gs = g.narrow(0, s, n).unsqueeze(1);  // [n, 1]
      // dlogits = g * (onehot - softmax), then the 1/temperature of the scaling; in place.
      auto dlogits = logits.sub_(lse.narrow(0, s, n).unsqueeze(1)).exp_().mul_(-gs);
      dlogits.scatter_add_(1, targets.narrow(0, s, n).unsqueeze(1), gs);
      if (temperature != 1.0) dlogits.div_(temperature);
      auto dh = dhidden.narrow(0, s, n);
      if (hidden.scalar_type() != weight.scalar_type()) {  // bf16-mixed, as in ChunkLogits
        dh.copy_(MatmulFp32(dlogits, weight, ComputeDtype(weight)));
        AddMatmulFp32(dweight, dlogits.t(), h, ComputeDtype(weight));
        continue;
      }
      dlogits = dlogits.to(hidden.scalar_type());
      torch::mm_out(dh, dlogits, weight);
      dweight.addmm_(dlogits.t(), h);
    }
    return {dhidden, dweight.to(weight.scalar_type()), torch::Tensor(), torch::Tensor(),
            torch::Tensor()};
  }
};

}  // namespace

torch::Tensor TokenLogprobs(const torch::Tensor& hidden, const torch::Tensor& weight,
                            const torch::Tensor& targets, const LogprobOptions& opts,
                            torch::Tensor* entropy) {
  if (entropy) {
    torch::NoGradGuard no_grad;
    const int64_t N = hidden.size(0);
    *entropy = torch::empty({N}, hidden.options().dtype(torch::kFloat32));
    auto scratch = Scratch(hidden, weight, opts.chunk_rows);
    for (int64_t s = 0; s < N; s += opts.chunk_rows) {
      const int64_t n = std::min(opts.chunk_rows, N - s);
      auto lp = ChunkLogits(scratch, hidden.narrow(0, s, n), weight, opts.temperature);
      lp.sub_(lp.logsumexp(1, /*keepdim=*/true));
      entropy->narrow(0, s, n).copy_(-(lp.exp() * lp).sum(-1));
    }
  }
  if (const auto fast = FastPathsFor(hidden.device().type()).token_logprobs; fast && !entropy) {
    torch::Tensor lp = fast(hidden, weight, targets, opts.temperature);  // scoring
    if (lp.defined()) return lp;
  }
  return ChunkedTokenLogprob::apply(hidden, weight, targets, opts.temperature, opts.chunk_rows);
}

TopKLogprobs TopK(const torch::Tensor& hidden, const torch::Tensor& weight, int64_t k,
                  const LogprobOptions& opts) {
  torch::NoGradGuard no_grad;
  const int64_t N = hidden.size(0);
  TopKLogprobs r{torch::empty({N, k}, hidden.options().dtype(torch::kInt64)),
                 torch::empty({N, k}, hidden.options().dtype(torch::kFloat32))};
  auto scratch = Scratch(hidden, weight, opts.chunk_rows);
  for (int64_t s = 0; s < N; s += opts.chunk_rows) {
    const int64_t n = std::min(opts.chunk_rows, N - s);
    auto lp = ChunkLogits(scratch, hidden.narrow(0, s, n), weight, opts.temperature);
    // Batch-invariant: each row's log-sum-exp alone (the library's exp leaves position-dependent
    // scalar tails, and a lone row of the vocabulary is split across threads).
    lp.sub_(BatchInvariant() ? InvariantLogSumExpRows(lp).unsqueeze(1)
                             : lp.logsumexp(1, /*keepdim=*/true));
    auto [v, i] = lp.topk(k, -1);
    r.ids.narrow(0, s, n).copy_(i);
    r.logprobs.narrow(0, s, n).copy_(v);
  }
  return r;
}

}  // namespace lm
