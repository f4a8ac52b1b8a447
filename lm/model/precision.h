// Mixed precision for the learner (train.precision = bf16-mixed): which parameters are held as
// bf16 compute copies, the matmuls that take bf16 inputs with fp32 accumulation and an fp32
// output, and the autocast scope the forward runs in.
//
//   bf16 compute copies: every matrix a matmul reads (attention and MLP projections, the fused
//     experts, the embedding / LM head), which is almost all of the weights.
//   kept in fp32:        1-D parameters (norm weights, biases, Qwen3-Next's A_log and dt_bias),
//     the routers (mlp.gate.weight, shared_expert_gate.weight) and the short convolution. They are
//     a fraction of a percent of the bytes, and their precision matters out of proportion: a
//     router's logits pick the experts by top-k (an error of one bf16 ulp flips near-ties and
//     sends tokens to other experts), and a norm weight near 1 moves by less than one bf16 ulp
//     (2^-8) per step at learning rates of 1e-5, so a bf16 norm weight could not even be read
//     back as updated.
//
// The fp32 master weights and the AdamW state live in the optimizer (trainer/common/zero1.h).
#pragma once

#include <string>

#include <torch/types.h>

namespace lm {

// True for the parameters bf16-mixed holds as bf16 compute copies (see above).
bool HoldsBf16ComputeCopy(const std::string& name, const torch::Tensor& param);

// a [n, k] times b [k, m] with both inputs rounded to `compute` (bf16 or fp32), the products
// accumulated in fp32 and the result in fp32, as a bf16 tensor-core GEMM with an fp32 output
// computes it. On CUDA that is one cuBLAS call (at::mm with out_dtype); on the CPU the rounded
// inputs are multiplied in fp32, which is the same arithmetic (a product of two bf16 numbers is
// exact in fp32), only slower.
torch::Tensor MatmulFp32(const torch::Tensor& a, const torch::Tensor& b, torch::ScalarType compute);

// acc (fp32) += a b, with a and b rounded to `compute` and fp32 accumulation.
void AddMatmulFp32(torch::Tensor& acc, const torch::Tensor& a, const torch::Tensor& b,
                   torch::ScalarType compute);

// The dtype a matmul against weight `w` computes in: bf16 for a bf16 weight, else fp32.
inline torch::ScalarType ComputeDtype(const torch::Tensor& w) {
  return w.scalar_type() == torch::kBFloat16 ? torch::kBFloat16 : torch::kFloat32;
}

// The LM head of every process (sampler, engine, scorer, learner): hidden [..., H] times
// weight [V, H]^T -> fp32 logits [..., V]. fp32 hidden and weight: MatmulWeightT, bit for bit
// what an fp32 model always computed. Otherwise the operands are rounded to the weight's compute
// dtype (bf16 hidden states as the rollout has them, or the learner's fp32 ones rounded to bf16)
// and multiplied by MatmulFp32: fp32 accumulation and an fp32 output, never rounded to bf16.
// A bf16-rounded logit is off by up to half an ulp, 2^-9 |z| (0.03-0.06 nats at |z| of 16-32),
// all of which lands in the importance ratio and the reverse KL; the same bf16 operands with
// fp32 accumulation in whatever order differ between processes by fp32 rounding only (about
// H * 2^-24 * sum_h |hidden_h weight_vh|). Runs outside autocast: its output is fp32 even in
// the learner's bf16 autocast scope.
torch::Tensor LogitsFp32(const torch::Tensor& hidden, const torch::Tensor& weight);

// While alive (and `enabled`), the ops autocast knows (linear, matmul, attention) run in bf16 on
// `device`'s type: they then accept fp32 activations next to bf16 weights. Our own autograd
// functions (experts, LM head) take mixed dtypes themselves. Thread-local, as autocast is.
class Bf16Autocast {
 public:
  Bf16Autocast(bool enabled, torch::Device device);
  ~Bf16Autocast();
  Bf16Autocast(const Bf16Autocast&) = delete;
  Bf16Autocast& operator=(const Bf16Autocast&) = delete;

 private:
  bool enabled_;
  c10::DeviceType type_;
  bool was_enabled_ = false;
  c10::ScalarType was_dtype_ = c10::kBFloat16;
};

}  // namespace lm
