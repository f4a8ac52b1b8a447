#include "trainer/sft/fused_nll.h"

#include <torch/torch.h>

#include "lm/model/precision.h"

namespace trainer {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// The [chunk, V] fp32 logits of a chunk are the largest temporary of a training step (0.3 GB for
// 512 rows of a 151,936-word vocabulary). On the CPU a fresh allocation of that size is mmap'ed
// and page-faulted in again every time, which costs about as much as the exp over it; one buffer
// per thread, reused by every call, costs it once. (CUDA's caching allocator already reuses.)
torch::Tensor ChunkLogits(const torch::Tensor& h, const torch::Tensor& weight) {
  // bf16-mixed: fp32 hidden states against a bf16 LM head, fp32 logits (lm/model/precision.h).
  if (h.scalar_type() != weight.scalar_type())
    return lm::MatmulFp32(h, weight.t(), lm::ComputeDtype(weight));
  if (!h.is_cpu()) return torch::mm(h, weight.t()).to(torch::kFloat32);
  thread_local torch::Tensor workspace;
  const int64_t n = h.size(0), vocab = weight.size(0);
  if (!workspace.defined() || workspace.numel() < n * vocab) {
    workspace = torch::empty({n * vocab}, h.options().dtype(torch::kFloat32));
  }
  auto logits = workspace.narrow(0, 0, n * vocab).view({n, vocab});
  if (h.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32) {
    return torch::mm_out(logits, h, weight.t());
  }
  return logits.copy_(torch::mm(h, weight.t()));
}

// Per chunk of rows h [n, H]:
//   logits = h W^T (fp32), lse = logsumexp(logits), loss += sum(lse - logits[target])
//   dlogits = softmax(logits) - onehot(target)          (d loss / d logits)
//   dh = dlogits W,  dW += dlogits^T h
class FusedNll : public torch::autograd::Function<FusedNll> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& hidden,
                               const torch::Tensor& weight, const torch::Tensor& targets,
                               int64_t chunk) {
    const bool grads = hidden.requires_grad() || weight.requires_grad();
    const int64_t N = hidden.size(0);
    auto loss = torch::zeros({}, hidden.options().dtype(torch::kFloat32));
    torch::Tensor dhidden, dweight;
    if (grads) {
      dhidden = torch::empty_like(hidden);
      dweight = torch::zeros(weight.sizes(), weight.options().dtype(torch::kFloat32));
    }
    for (int64_t s = 0; s < N; s += chunk) {
      const int64_t n = std::min(chunk, N - s);
      auto h = hidden.narrow(0, s, n);
      auto t = targets.narrow(0, s, n).unsqueeze(1);
      auto logits = ChunkLogits(h, weight);  // [n, V] fp32
      auto lse = logits.logsumexp(1, /*keepdim=*/true);
      loss += (lse - logits.gather(1, t)).sum();
      if (!grads) continue;
      auto dlogits = logits.sub_(lse).exp_();  // softmax, in place of the logits
      dlogits.scatter_add_(1, t, torch::full({n, 1}, -1.0, dlogits.options()));
      auto dh = dhidden.narrow(0, s, n);
      if (hidden.scalar_type() != weight.scalar_type()) {  // bf16-mixed, as in ChunkLogits
        dh.copy_(lm::MatmulFp32(dlogits, weight, lm::ComputeDtype(weight)));
        lm::AddMatmulFp32(dweight, dlogits.t(), h, lm::ComputeDtype(weight));
        continue;
      }
      auto dl = dlogits.to(hidden.scalar_type());
      torch::mm_out(dh, dl, weight);
      dweight.addmm_(dl.t(), h);
    }
    ctx->save_for_backward({dhidden, dweight});
    ctx->saved_data["weight_dtype"] = static_cast<int64_t>(weight.scalar_type());
    return loss;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grad_outputs) {
    auto saved = ctx->get_saved_variables();
    const auto g = grad_outputs[0];  // 0-dim: the loss is a sum
    const auto dtype = static_cast<torch::ScalarType>(ctx->saved_data["weight_dtype"].toInt());
    // In place: the saved gradients are used once (the graph is not retained).
    auto dhidden = saved[0].mul_(g.to(saved[0].scalar_type()));
    auto dweight = saved[1].mul_(g).to(dtype);
    return {dhidden, dweight, torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor FusedNllSum(const torch::Tensor& hidden, const torch::Tensor& weight,
                          const torch::Tensor& targets, int64_t chunk_rows) {
  return FusedNll::apply(hidden, weight, targets, chunk_rows);
}

}  // namespace trainer
