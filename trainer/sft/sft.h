// `opd-trainer sft`: supervised fine-tuning of a student on chat data.
//
// One optimizer step consumes train.global_batch_size packed sequences, processed in micro-batches
// of train.micro_batch_size with gradient accumulation. The loss of a step is
//
//   L = (sum over every trained token of the step of -log p(token)) / N_step
//       + aux_coef * (mean over the step's micro-batches of the load-balancing loss)
//
// where N_step counts the trained (assistant) tokens of the whole step. Each micro-batch
// backpropagates its own token sum divided by the step's N_step, so the gradient equals that of the
// mean over all the step's tokens whatever the micro-batch split and whatever their token counts
// (token-level normalisation, as a single big batch would compute it; not a mean of per-batch
// means). The load-balancing loss is computed per micro-batch over its tokens, as transformers
// computes it per forward. The cross-entropy goes through FusedNllSum (trainer/sft/fused_nll.h):
// chunked over the vocabulary, with its gradients formed in the forward.
//
// fp32 on the CPU. On a GPU the weights (and the optimizer) stay fp32 and the forward runs under
// bf16 autocast.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "lm/util/config.h"
#include "trainer/common/job_args.h"
#include "trainer/sft/sft_config.h"

namespace trainer {

// Runs the job. OK at the end of training; CancelledError when stopped by SIGINT/SIGTERM (after a
// checkpoint); any other error names the problem (bad inputs fail before the first step).
absl::Status RunSft(const SftConfig& config, const JobArgs& args);

// The sub-command: parses `--config FILE [--set k=v ...] [--resume[=DIR]]`, runs, and returns the
// exit code (0 done, 1 failed, 2 bad command line or config, 128+signal when stopped).
int SftMain(const std::vector<std::string>& args);

}  // namespace trainer
