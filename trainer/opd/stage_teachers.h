// The running stage's teachers: its default pool and a pool per data domain, the endpoints every
// stage uses (the config's, as changed by swaps, which outlive restarts), and teacher swaps at
// step boundaries.
//
// A swap is four moves, because only rank 0 serves the admin RPC but every rank scores: rank 0
// takes the queued call (LearnerServer::TakeSwap), announces it to every rank, every rank connects
// its own pool (and all agree: one rank that cannot connect refuses the swap for all), and rank 0
// answers the caller with the outcome. A refused swap changes nothing. Every change of pools (a
// swap of the running stage, a new stage) moves generation() on, so that samples scored by the
// old pools are scored again (StepPipeline::StartScoring).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lm/dist/rank_sync.h"
#include "lm/generate/sampling.h"
#include "nlohmann/json.hpp"
#include "trainer/opd/learner_service.h"
#include "trainer/opd/opd_config.h"
#include "trainer/opd/score_stream.h"
#include "trainer/opd/teacher_pool.h"

namespace trainer {

// How errors and metrics name a domain's pool: "stage/domain".
std::string DomainPoolName(const std::string& stage, const std::string& domain);

class StageTeachers {
 public:
  // `stages` are the config's; `requirements` what every teacher must agree on with the student;
  // `options` every pool's (deadlines, TLS, secret, canceller).
  StageTeachers(std::vector<OpdStageConfig> stages, TeacherRequirements requirements,
                TeacherPoolOptions options);

  // Endpoints swapped in by an earlier run of this job (its checkpoint's record).
  void RestoreSwaps(const nlohmann::json& stages, const nlohmann::json& domains);
  nlohmann::json swapped_stages() const { return swapped_; }
  nlohmann::json swapped_domains() const { return swapped_domains_; }

  // Connects stage `index`'s pools, checked against the student; on error nothing changes.
  absl::Status Connect(size_t index);
  const OpdStageConfig& stage() const { return stages_[index_]; }

  // The stage's pools now (a swap replaces them for later users).
  const TeacherPools& pools() const { return pools_; }
  // Domains with metrics of their own: the stage's, then "other" (none without domains).
  const std::vector<std::string>& metric_domains() const { return metric_domains_; }
  int64_t generation() const { return generation_; }
  int64_t failovers() const;

  // A swap applied at this step boundary: its stage and domain ("" for the default pool).
  struct Applied {
    std::string stage, domain;
    bool running;  // it changed the running stage's pools
  };
  // The four moves (above), the ranks meeting through `sync`. `admin` is rank 0's admin server
  // (null elsewhere or without one). An error is the meeting's (a stall): it ends the job; a
  // refused swap is OK and nullopt.
  absl::StatusOr<std::optional<Applied>> ApplyPendingSwap(LearnerServer* admin, bool root,
                                                          lm::dist::RankSync& sync);

 private:
  absl::StatusOr<std::optional<SwapRequest>> Announce(const SwapRequest* mine, bool root,
                                                      lm::dist::RankSync& sync);
  Applied Install(const SwapRequest& swap, std::unique_ptr<TeacherPool> pool);
  // A domain pool's options: the stage's on_domain_down decides whether it waits for a replica.
  TeacherPoolOptions DomainOptions(const OpdStageConfig& stage) const;

  std::vector<OpdStageConfig> stages_;  // endpoints as swapped
  const TeacherRequirements req_;
  const TeacherPoolOptions opts_;
  size_t index_ = 0;
  TeacherPools pools_;
  std::vector<std::string> metric_domains_;
  int64_t generation_ = 0;
  nlohmann::json swapped_ = nlohmann::json::object();          // {stage: endpoints}
  nlohmann::json swapped_domains_ = nlohmann::json::object();  // {stage: {domain: endpoints}}
};

}  // namespace trainer
