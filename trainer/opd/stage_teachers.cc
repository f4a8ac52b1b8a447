#include "trainer/opd/stage_teachers.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "lm/util/log.h"
#include "lm/util/status.h"

namespace trainer {

namespace {
constexpr const char* kOtherDomain = "other";  // metrics of the domains without a pool
}  // namespace

std::string DomainPoolName(const std::string& stage, const std::string& domain) {
  return absl::StrCat(stage, "/", domain);
}

StageTeachers::StageTeachers(std::vector<OpdStageConfig> stages, TeacherRequirements requirements,
                             TeacherPoolOptions options)
    : stages_(std::move(stages)), req_(std::move(requirements)), opts_(std::move(options)) {}

void StageTeachers::RestoreSwaps(const nlohmann::json& stages, const nlohmann::json& domains) {
  swapped_ = stages;
  swapped_domains_ = domains;
  for (auto& s : stages_) {
    if (swapped_.contains(s.name)) s.teachers = swapped_[s.name].get<std::vector<std::string>>();
    if (!swapped_domains_.contains(s.name)) continue;
    for (auto& d : s.domains) {
      if (swapped_domains_[s.name].contains(d.domain))
        d.teachers = swapped_domains_[s.name][d.domain].get<std::vector<std::string>>();
    }
  }
}

absl::Status StageTeachers::Connect(size_t index) {
  const OpdStageConfig& s = stages_[index];
  ASSIGN_OR_RETURN(std::shared_ptr<TeacherPool> pool,
                   TeacherPool::Connect(s.name, s.teachers, req_, opts_));
  TeacherPools pools{std::move(pool), {}};
  std::vector<std::string> metric_domains;
  for (const auto& d : s.domains) {
    ASSIGN_OR_RETURN(
        pools.by_domain[d.domain],
        TeacherPool::Connect(DomainPoolName(s.name, d.domain), d.teachers, req_, opts_));
    metric_domains.push_back(d.domain);
  }
  if (!s.domains.empty()) metric_domains.push_back(kOtherDomain);
  index_ = index;
  pools_ = std::move(pools);
  metric_domains_ = std::move(metric_domains);
  ++generation_;
  lm::log::Info(absl::StrFormat("stage %d/%d '%s': teachers %s", index + 1, stages_.size(), s.name,
                                absl::StrJoin(s.teachers, ", ")));
  return absl::OkStatus();
}

TeacherPoolOptions StageTeachers::DomainOptions(const OpdStageConfig& stage) const {
  TeacherPoolOptions o = opts_;
  o.give_up_when_all_down = stage.on_domain_down == DomainDownPolicy::kDefaultPool;
  return o;
}

int64_t StageTeachers::failovers() const {
  int64_t n = 0;
  if (pools_.fallback)
    for (const auto& p : pools_.all()) n += p->failovers();
  return n;
}

absl::StatusOr<std::optional<StageTeachers::Applied>> StageTeachers::ApplyPendingSwap(
    LearnerServer* admin, bool root, lm::dist::RankSync& sync) {
  std::unique_ptr<LearnerServer::TakenSwap> taken = admin && root ? admin->TakeSwap() : nullptr;
  ASSIGN_OR_RETURN(const std::optional<SwapRequest> swap,
                   Announce(taken ? &taken->request() : nullptr, root, sync));
  if (!swap) return std::nullopt;
  // Every rank connects to the swap's endpoints (checked against the student as at a stage's
  // start) and all agree: one rank that cannot connect refuses the swap for all.
  const std::string name =
      swap->domain.empty() ? swap->stage : DomainPoolName(swap->stage, swap->domain);
  const OpdStageConfig* stage = nullptr;
  for (const auto& s : stages_)
    if (s.name == swap->stage) stage = &s;
  absl::StatusOr<std::unique_ptr<TeacherPool>> pool =
      stage == nullptr ? absl::InvalidArgumentError(absl::StrCat("no stage '", swap->stage, "'"))
                       : TeacherPool::Connect(name, swap->endpoints, req_,
                                              swap->domain.empty() ? opts_ : DomainOptions(*stage));
  const absl::Status agreed = sync.Agree("teacher swap connected", pool.status());
  std::optional<Applied> applied;
  if (agreed.ok()) applied = Install(*swap, std::move(*pool));
  if (taken) taken->Answer(agreed);
  if (sync.broken()) return agreed;
  return applied;
}

// Rank 0's request (null: none) on every rank, as JSON with an explicit flag.
absl::StatusOr<std::optional<SwapRequest>> StageTeachers::Announce(const SwapRequest* mine,
                                                                   bool root,
                                                                   lm::dist::RankSync& sync) {
  const std::string announced =
      root ? nlohmann::json{{"swap", mine != nullptr},
                            {"stage", mine ? mine->stage : ""},
                            {"endpoints", mine ? mine->endpoints : std::vector<std::string>{}},
                            {"domain", mine ? mine->domain : ""}}
                 .dump()
           : "";
  ASSIGN_OR_RETURN(std::vector<std::string> all,
                   sync.Exchange("teacher swap announced", absl::OkStatus(), announced));
  const nlohmann::json j = nlohmann::json::parse(all[0], nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.contains("swap"))
    return absl::DataLossError("rank 0's swap announcement is unreadable");
  if (!j.at("swap").get<bool>()) return std::nullopt;
  return SwapRequest{j.at("stage").get<std::string>(),
                     j.at("endpoints").get<std::vector<std::string>>(),
                     j.at("domain").get<std::string>()};
}

// The swap takes effect: the stages (and the record that outlives a restart) name the new
// endpoints; for the running stage the pool changes now.
StageTeachers::Applied StageTeachers::Install(const SwapRequest& swap,
                                              std::unique_ptr<TeacherPool> pool) {
  Applied applied{swap.stage, swap.domain, false};
  for (size_t i = 0; i < stages_.size(); ++i) {
    OpdStageConfig& s = stages_[i];
    if (s.name != swap.stage) continue;
    applied.running = i == index_;
    if (swap.domain.empty()) {
      s.teachers = swap.endpoints;
      swapped_[s.name] = swap.endpoints;
      if (applied.running) pools_.fallback = std::move(pool);
    } else {
      for (auto& d : s.domains) {
        if (d.domain == swap.domain) d.teachers = swap.endpoints;
      }
      swapped_domains_[s.name][swap.domain] = swap.endpoints;
      if (applied.running) pools_.by_domain[swap.domain] = std::move(pool);
    }
    if (applied.running) ++generation_;
  }
  return applied;
}

}  // namespace trainer
