// The residual stream of a decoder, h, as its layers use it: each block reads norm(h) and adds its
// output back (h += block(norm(h))). The add is held until the next norm reads h, which then does
// both in one pass where a device has the kernel (RMSNormImpl::AddForward: the same ops as
// h = h + delta; norm(h) under autograd and wherever no kernel applies).
#pragma once

#include <utility>

#include <torch/types.h>

#include "lm/model/layers.h"

namespace lm {

class ResidualStream {
 public:
  explicit ResidualStream(torch::Tensor h) : h_(std::move(h)) {}

  // h += delta.
  void Add(torch::Tensor delta) {
    Sum();
    pending_ = std::move(delta);
  }
  // norm(h), the pending add summed into h on the way.
  torch::Tensor Norm(RMSNormImpl& norm) {
    if (!pending_.defined()) return norm.forward(h_);
    torch::Tensor delta = std::move(pending_);
    pending_ = torch::Tensor();
    return norm.AddForward(delta, h_);
  }
  // h, every add summed.
  const torch::Tensor& Sum() {
    if (pending_.defined()) {
      h_ = h_ + pending_;
      pending_ = torch::Tensor();
    }
    return h_;
  }
  // The final norm at `rows` of h (index_select; every row when undefined).
  torch::Tensor Final(RMSNormImpl& norm, const torch::Tensor& rows) {
    if (!rows.defined()) return Norm(norm);
    return norm.forward(Sum().index_select(0, rows));
  }

 private:
  torch::Tensor h_;
  torch::Tensor pending_;  // the block output not yet added to h_
};

}  // namespace lm
