// The time of one OPD step as the job runs it: the rollout workers, the teachers and the learner
// ranks work at once on streams of samples (trainer/opd/step_pipeline.h), so a step costs its
// slowest stage plus the work that cannot overlap, not the sum of the phases.
//
// Each process's roofline (lm/plan/plan.h, 100% of the device's peak) is divided by the share of
// that roof our kernels reached on an H200 (docs/gpu.md, "Results on an H200"), per process kind
// and per bound, so the figure is an estimate of a real run, not a lower bound. Then, with S, T,
// L the sampling, scoring and learning of one step, O the reductions and the optimizer, P the push:
//
//   phase by phase (train.pipeline false):  S + T + L + O + P
//   pipelined:    max(S, T, L) + tail,  tail = one scoring call + one micro-batch + O + P
//                 (what runs after the last sample arrives)
//   one-step-off (train.async): the next step samples while this one learns and pushes, so
//                 max(S, T + one scoring call, L + O + P) + one micro-batch
//
// The push: every worker receives the student's bf16 weights once (every learner rank sends its
// 1/N share of a broadcast, trainer/opd/weight_push.h), at `push_bytes_per_s` per worker.
#pragma once

#include <string>

#include "lm/plan/plan.h"

namespace lm::plan {

// Shares of the roofline reached on the H200 (docs/gpu.md); parameters, not constants, so a later
// measurement replaces them with a flag.
struct Efficiencies {
  // Decode: the paged attention kernel reads KV at 28% of HBM bandwidth (1.33 TB/s at B = 256 x
  // 8k), the MoE decode layer its weights at ~55%: the KV-dominated mix, 0.3.
  double decode_hbm = 0.30;
  // Prefill and scoring: the MoE layer's prefill GEMMs at 176-195 TFLOP/s, 18-20% of the bf16
  // peak; attention runs nearer its roof, so 0.2 for the whole forward.
  double forward_compute = 0.20;
  // The learner's forward + backward: the Marco-Nano MoE layer's step at 16k tokens, 91 TFLOP/s of
  // model FLOPs (9% of peak).
  double learn_compute = 0.09;
  // Memory-bound passes over the weights (the optimizer, the teacher's weight reads): 0.5.
  double stream_hbm = 0.50;
  // One worker's share of a weight push's broadcast: 25 GB/s (an H200's 400 Gb/s NIC at ~50%).
  double push_bytes_per_s = 25e9;
};

struct StepShape {
  bool pipeline = true;
  bool async = false;
  int64_t student_weight_bytes = 0;  // what a push sends to each worker (bf16)
  int64_t micro_batches = 1;         // per learner rank per step
  int64_t score_calls = 1;           // per teacher replica per step
};

struct StepPlan {
  double sample = 0, score = 0, learn = 0, optimizer = 0, push = 0;
  double score_call = 0, micro_batch = 0;  // the pieces the tail is made of
  double step = 0;
  std::string formula;  // how `step` is built from the parts, with their values
};

// The seconds of a process plan's time terms at the efficiencies `e` for `kind` ("rollout",
// "teacher", "learner"): compute-bound and HBM-bound terms each divided by their share.
double EstimatedSeconds(const TimePlan& t, const std::string& kind, const Efficiencies& e);
// The step of one stage from its three process plans (the learner's last time term is its
// optimizer, the rest its forward and backward).
StepPlan PlanStep(const ProcessPlan& rollout, const ProcessPlan& teacher,
                  const ProcessPlan& learner, const StepShape& shape, const Efficiencies& e);

}  // namespace lm::plan
