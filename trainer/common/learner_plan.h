// What the memory and time plan (lm/plan/plan.h) takes from a learner job's config: one place for
// opd-ctl plan and the learner's own start-up check, so both plan the same micro-batch.
// Header-only: no library of its own to link, and nothing here needs torch.
#pragma once

#include <algorithm>
#include <cstdint>

#include "lm/plan/plan.h"
#include "trainer/opd/opd_config.h"
#include "trainer/sft/sft_config.h"

namespace trainer {

// dist.zero_stage and dist.bucket_mb as the plan takes them.
inline void SetDistPlan(const DistConfig& d, lm::plan::LearnerSettings& s) {
  s.zero_stage = d.zero_stage == ZeroStage::kOne ? 1 : d.zero_stage == ZeroStage::kTwo ? 2 : 0;
  s.bucket_elements = static_cast<int64_t>(d.bucket_mb * (1 << 20) / 4);
}

// SFT: micro-batches of micro_batch_size packed sequences of data.max_seq_len tokens,
// global_batch_size of them per step; the fused NLL's 512-row logits chunk (sft/fused_nll.h).
inline lm::plan::LearnerSettings LearnerPlanSettings(const SftConfig& c, int64_t ranks,
                                                     bool bf16_mixed, bool cuda) {
  lm::plan::LearnerSettings s;
  s.ranks = ranks;
  s.bf16_mixed = bf16_mixed;
  s.cuda = cuda;
  s.sequence_len = c.data.max_seq_len;
  s.micro_batch_tokens = c.train.micro_batch_size * c.data.max_seq_len;
  s.tokens_per_step = c.train.global_batch_size * c.data.max_seq_len;
  s.activation_checkpointing = c.train.activation_checkpointing;
  s.logits_chunk_rows = 512;
  SetDistPlan(c.dist, s);
  return s;
}

// OPD: prompts_per_step x samples_per_prompt sequences of at most max_prompt_len +
// max_new_tokens tokens per step (the longest case), in chunks of micro_batch_tokens (a longer
// sequence alone); lm::TokenLogprobs' 1024-row logits chunk (lm/model/logprobs.h).
inline lm::plan::LearnerSettings LearnerPlanSettings(const OpdConfig& c, int64_t ranks,
                                                     bool bf16_mixed, bool cuda) {
  lm::plan::LearnerSettings s;
  s.ranks = ranks;
  s.bf16_mixed = bf16_mixed;
  s.cuda = cuda;
  s.sequence_len = c.prompts.max_prompt_len + c.rollout.max_new_tokens;
  s.micro_batch_tokens = std::max(c.train.micro_batch_tokens, s.sequence_len);
  s.tokens_per_step = c.train.prompts_per_step * c.rollout.samples_per_prompt * s.sequence_len;
  s.activation_checkpointing = c.train.activation_checkpointing;
  s.logits_chunk_rows = 1024;
  SetDistPlan(c.dist, s);
  return s;
}

}  // namespace trainer
