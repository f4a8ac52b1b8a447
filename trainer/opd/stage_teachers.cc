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

int64_t StageTeachers::failovers() const {
  int64_t n = 0;
  if (pools_.fallback)
    for (const auto& p : pools_.all()) n += p->failovers();
  return n;
}

absl::StatusOr<std::optional<StageTeachers::Applied>> StageTeachers::ApplyPendingSwap(
    LearnerServer* admin, lm::dist::ProcessGroup& group) {
  if (group.size() == 1 && !admin) return std::nullopt;
  std::unique_ptr<LearnerServer::TakenSwap> taken =
      admin && group.is_root() ? admin->TakeSwap() : nullptr;
  ASSIGN_OR_RETURN(const std::optional<SwapRequest> swap,
                   Announce(taken ? &taken->request() : nullptr, group));
  if (!swap) return std::nullopt;
  absl::Status collective = absl::OkStatus();
  absl::StatusOr<std::unique_ptr<TeacherPool>> pool = ConnectSwap(*swap, group, &collective);
  std::optional<Applied> applied;
  if (pool.ok()) applied = Install(*swap, std::move(*pool));
  if (taken) taken->Answer(pool.status());
  RETURN_IF_ERROR(collective);
  return applied;
}

// Rank 0's request (null: none) on every rank, as JSON with an explicit flag.
absl::StatusOr<std::optional<SwapRequest>> StageTeachers::Announce(const SwapRequest* mine,
                                                                   lm::dist::ProcessGroup& group) {
  std::string announced = nlohmann::json{
      {"swap", mine != nullptr},
      {"stage", mine ? mine->stage : ""},
      {"endpoints", mine ? mine->endpoints : std::vector<std::string>{}},
      {"domain", mine ? mine->domain
                      : ""}}.dump();
  RETURN_IF_ERROR(group.BroadcastBytes(&announced));
  const nlohmann::json j = nlohmann::json::parse(announced, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.contains("swap"))
    return absl::DataLossError("rank 0's swap announcement is unreadable");
  if (!j.at("swap").get<bool>()) return std::nullopt;
  return SwapRequest{j.at("stage").get<std::string>(),
                     j.at("endpoints").get<std::vector<std::string>>(),
                     j.at("domain").get<std::string>()};
}

// Every rank connects to the swap's endpoints (checked against the student as at a stage's
// start) and all agree: one rank that cannot connect refuses the swap for all.
absl::StatusOr<std::unique_ptr<TeacherPool>> StageTeachers::ConnectSwap(
    const SwapRequest& swap, lm::dist::ProcessGroup& group, absl::Status* collective) {
  const std::string name =
      swap.domain.empty() ? swap.stage : DomainPoolName(swap.stage, swap.domain);
  absl::StatusOr<std::unique_ptr<TeacherPool>> pool =
      TeacherPool::Connect(name, swap.endpoints, req_, opts_);
  std::vector<double> failed(static_cast<size_t>(group.size()), 0.0);
  failed[static_cast<size_t>(group.rank())] = pool.ok() ? 0.0 : 1.0;
  absl::StatusOr<std::vector<double>> agreed = group.AllReduceDoubles(failed);
  if (!agreed.ok()) return *collective = agreed.status();
  if (!pool.ok()) return pool.status();
  for (size_t r = 0; r < agreed->size(); ++r) {
    if ((*agreed)[r] > 0)
      return absl::UnavailableError(
          absl::StrCat("learner rank ", r, " cannot connect to the new teachers (see its log)"));
  }
  return pool;
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
