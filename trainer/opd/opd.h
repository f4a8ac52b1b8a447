// `opd-trainer opd`: cascaded on-policy distillation.
//
// One step:
//   1. draw prompts_per_step prompts;
//   2. the rollout workers sample samples_per_prompt responses each (spread over all workers);
//   3. the stage's teacher replicas score every sampled response token (spread, with failover);
//   4. the learner recomputes the student's log-probs with the current weights and minimises the
//      per-token reverse KL (trainer/opd/opd_loss.h), micro-batched under a token budget;
//   5. the new weights are pushed to every rollout worker under a new version.
// Stages run in order; each ends by its convergence rule (trainer/opd/convergence.h) with a
// checkpoint and a summary, then the next stage's teachers are connected and checked (tokenizer
// fingerprint, vocabulary) before any step is spent on them. Teachers can be swapped while running
// through the learner's admin RPC; the swap takes effect at the next step boundary, with the same
// checks.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "lm/util/config.h"
#include "trainer/common/job_args.h"
#include "trainer/opd/opd_config.h"

namespace trainer {

absl::Status RunOpd(const OpdConfig& config, const JobArgs& args);
int OpdMain(const std::vector<std::string>& args);

}  // namespace trainer
