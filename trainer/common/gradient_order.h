// The order in which a backward of the learner's model produces its parameters' gradients: the
// order the sharded optimizer lays its flat space out in (trainer/common/zero1.h), so that its
// gradient buckets complete one after the other and stage 2 holds a few staging buckets rather
// than whatever arrives ahead of its turn. Reverse model order is close but not it: a fused
// experts' gate_up_proj, for one, arrives before the down_proj registered after it.
#pragma once

#include <string>
#include <vector>

#include <torch/types.h>

#include "absl/status/statusor.h"
#include "lm/model/model.h"
#include "trainer/common/mixed_precision.h"

namespace trainer {

// One forward and backward of a three-token sequence through `model`, where its weights are (the
// learner loads them on the host before placing them), in the learner's precision and with its
// layers recomputed when `checkpoint_layers`, as in training; it records the order of the
// parameters' gradient accumulations, each gradient dropped as it arrives. Training's autograd
// graph is the reference one on every device (the device fast paths serve gradient-free calls
// only), so the host's order is the device's. Parameters the backward does not reach are left out
// (FlatLayout::Of puts them after). The model's weights, its gradients (none) and the RNG are as
// they were.
absl::StatusOr<std::vector<std::string>> GradientArrivalOrder(lm::CausalLM& model,
                                                              Precision precision,
                                                              bool checkpoint_layers);

}  // namespace trainer
