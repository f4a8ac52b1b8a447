#include "trainer/common/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <regex>

#include <torch/cuda.h>
#include <torch/torch.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "lm/dist/process_group.h"
#include "lm/io/hf_model_dir.h"
#include "lm/io/safetensors.h"
#include "lm/util/file.h"
#include "lm/util/log.h"
#include "lm/util/status.h"
#include "trainer/common/run_dir.h"
#include "trainer/common/sections.h"  // limits

namespace trainer {
namespace {

namespace fs = std::filesystem;

constexpr char kTmpPrefix[] = ".tmp-";
constexpr char kStateFile[] = "trainer_state.json";

absl::Status CopyFiles(const std::vector<std::string>& files, const std::string& dir) {
  for (const std::string& f : files) {
    std::error_code ec;
    fs::copy_file(f, fs::path(dir) / fs::path(f).filename(), fs::copy_options::overwrite_existing,
                  ec);
    if (ec)
      return absl::InternalError(absl::StrCat(f, ": cannot copy into ", dir, ": ", ec.message()));
  }
  return absl::OkStatus();
}

// fsync every file below `dir`, then the directories: the rename that follows must not become
// visible before the data it names.
absl::Status SyncTree(const std::string& dir) {
  std::error_code ec;
  for (const auto& e : fs::recursive_directory_iterator(dir, ec)) {
    if (e.is_regular_file()) RETURN_IF_ERROR(lm::SyncPath(e.path().string()));
  }
  for (const auto& e : fs::recursive_directory_iterator(dir, ec)) {
    if (e.is_directory()) RETURN_IF_ERROR(lm::SyncPath(e.path().string()));
  }
  return lm::SyncPath(dir);
}

// "step_000100" -> 100; -1 for anything else (including .tmp- names).
int64_t ParseStepDir(const std::string& name) {
  static const std::regex re("step_([0-9]+)");
  std::smatch m;
  if (!std::regex_match(name, m, re)) return -1;
  return std::stoll(m[1].str());
}

std::string TensorToBase64(const torch::Tensor& t) {
  auto c = t.contiguous().to(torch::kCPU);
  return absl::Base64Escape(
      absl::string_view(static_cast<const char*>(c.data_ptr()), c.numel() * c.element_size()));
}

absl::StatusOr<torch::Tensor> Base64ToByteTensor(const std::string& text) {
  std::string bytes;
  if (!absl::Base64Unescape(text, &bytes))
    return absl::InvalidArgumentError("bad base64 RNG state");
  auto t = torch::empty({static_cast<int64_t>(bytes.size())}, torch::kUInt8);
  std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

}  // namespace

std::string StepDirName(int64_t step) {
  return absl::StrFormat("step_%06d", step);
}

namespace {

// The outcome of a step every rank took part in: an error on any rank is an error on all (the
// others learn which rank failed; its own message stays in its log).
absl::Status AgreeOnOutcome(absl::Status mine, lm::dist::ProcessGroup& group, const char* what) {
  if (group.size() == 1) return mine;
  std::vector<double> flags(static_cast<size_t>(group.size()), 0.0);
  flags[static_cast<size_t>(group.rank())] = mine.ok() ? 0.0 : 1.0;
  ASSIGN_OR_RETURN(flags, group.AllReduceDoubles(flags));
  if (!mine.ok()) return mine;
  for (size_t r = 0; r < flags.size(); ++r) {
    if (flags[r] > 0)
      return absl::InternalError(absl::StrCat(what, " failed on rank ", r, " (see its log)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckpointManager::Save(int64_t step, lm::CausalLM& model,
                                     DistributedOptimizer& optimizer, nlohmann::json state,
                                     const std::vector<std::string>& model_extra_files,
                                     lm::dist::ProcessGroup& group,
                                     const JobFilesWriter& job_files) {
  // Non-finite weights are never written: a resume from them could only fail (every later step
  // NaN), and they would push the last good checkpoint out of keep_last.
  if (absl::Status finite = optimizer.CheckFinite(); !finite.ok()) {
    absl::StatusOr<std::string> kept = Latest();
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step, " is not checkpointed: ", finite.message(), "; ",
                     kept.ok() ? absl::StrCat("the newest checkpoint, ", *kept, ", is kept")
                               : std::string("no checkpoint of this run exists")));
  }
  // The saved weights are the exact fp32 masters, whatever dtype the all-gathers used.
  RETURN_IF_ERROR(optimizer.SyncMasters());
  const std::string final_dir = dir_ + "/" + StepDirName(step);
  // Rank 0 decides and names the temporary directory; every rank then writes into it.
  std::string tmp;
  absl::Status prepared = absl::OkStatus();
  if (group.is_root()) {
    if (!fs::exists(fs::path(final_dir) / kStateFile)) {
      tmp = absl::StrCat(dir_, "/", kTmpPrefix, StepDirName(step), "-", ::getpid());
      std::error_code ec;
      fs::remove_all(tmp, ec);
      fs::create_directories(tmp + "/model", ec);
      if (ec) prepared = absl::InternalError(absl::StrCat(tmp, ": cannot create: ", ec.message()));
    }
  }
  RETURN_IF_ERROR(AgreeOnOutcome(prepared, group, "creating the checkpoint directory"));
  RETURN_IF_ERROR(group.BroadcastBytes(&tmp));
  if (tmp.empty()) return absl::OkStatus();  // a complete checkpoint of this step exists

  auto write = [&]() -> absl::Status {
    RETURN_IF_ERROR(optimizer.SaveState(tmp));
    if (job_files) RETURN_IF_ERROR(job_files(tmp));  // every rank: its own files
    if (!group.is_root()) return absl::OkStatus();
    lm::SaveOptions save;
    save.dtype = torch::kFloat32;  // master weights: an exact resume needs every bit
    RETURN_IF_ERROR(lm::SaveModel(model, tmp + "/model", save));
    RETURN_IF_ERROR(CopyFiles(model_extra_files, tmp + "/model"));
    state["version"] = kTrainerStateVersion;
    state["step"] = step;
    state["optimizer_steps"] = optimizer.steps();
    state["world_size"] = group.size();
    return lm::WriteFileAtomic(tmp + "/" + kStateFile, state.dump(2) + "\n");
  };
  // bf16-mixed: rank 0's model holds the fp32 masters while it is written (zero1.h).
  RETURN_IF_ERROR(optimizer.WithMasterWeights(
      [&] { return AgreeOnOutcome(write(), group, "writing the checkpoint"); }));

  absl::Status published = absl::OkStatus();
  if (group.is_root()) {
    published = [&]() -> absl::Status {
      RETURN_IF_ERROR(SyncTree(tmp));  // every rank's shard is written: flush all, then rename
      std::error_code ec;
      fs::remove_all(final_dir, ec);  // an incomplete directory of that name, if any
      fs::rename(tmp, final_dir, ec);
      if (ec)
        return absl::InternalError(absl::StrCat(final_dir, ": rename failed: ", ec.message()));
      RETURN_IF_ERROR(lm::SyncPath(dir_));
      Prune();
      return absl::OkStatus();
    }();
  }
  return AgreeOnOutcome(published, group, "publishing the checkpoint");
}

std::vector<std::pair<int64_t, std::string>> CheckpointManager::List() const {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir_, ec)) {
    const int64_t step = ParseStepDir(e.path().filename().string());
    if (step < 0 || !fs::exists(e.path() / kStateFile)) continue;
    out.emplace_back(step, e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

absl::StatusOr<std::string> CheckpointManager::Latest() const {
  auto all = List();
  if (all.empty()) return absl::NotFoundError(absl::StrCat("no complete checkpoint in ", dir_));
  return all.back().second;
}

absl::Status CheckCheckpointFiles(const std::string& checkpoint) {
  RETURN_IF_ERROR(ReadTrainerState(checkpoint).status());
  std::error_code ec;
  for (fs::recursive_directory_iterator it(checkpoint, ec), end; !ec && it != end;
       it.increment(ec)) {
    if (it->path().extension() != ".safetensors") continue;
    // Open checks the header and that every tensor's bytes lie inside the file.
    absl::Status s = lm::SafetensorsFile::Open(it->path().string()).status();
    if (!s.ok()) return absl::DataLossError(s.message());
  }
  if (ec) return absl::DataLossError(absl::StrCat(checkpoint, ": cannot list: ", ec.message()));
  return absl::OkStatus();
}

absl::StatusOr<std::string> CheckpointManager::LatestReadable() const {
  for (;;) {
    const auto all = List();
    if (all.empty()) return absl::NotFoundError(absl::StrCat("no complete checkpoint in ", dir_));
    const std::string& latest = all.back().second;
    const absl::Status files = CheckCheckpointFiles(latest);
    if (files.ok()) return latest;
    // The only one is never set aside: the run would start over.
    if (all.size() == 1)
      return absl::DataLossError(absl::StrCat("the only checkpoint of this run, ", latest,
                                              ", is unreadable: ", files.message()));
    // Its files were never all written (a crash or a full disk while saving): like an incomplete
    // checkpoint it holds no step, so the one before it is resumed. Kept aside, not deleted.
    const std::string aside = latest + ".unreadable";
    std::error_code ec;
    fs::rename(latest, aside, ec);
    if (ec)
      return absl::DataLossError(
          absl::StrCat(files.message(), "; and it cannot be set aside: ", ec.message()));
    lm::log::Warn(absl::StrCat("the newest checkpoint is unreadable (", files.message(),
                               "): moved to ", aside, "; resuming from ",
                               all[all.size() - 2].second));
  }
}

void CheckpointManager::RemoveIncomplete() const {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir_, ec)) {
    if (e.path().filename().string().rfind(kTmpPrefix, 0) != 0) continue;
    lm::log::Warn(absl::StrCat("removing an incomplete checkpoint: ", e.path().string()));
    fs::remove_all(e.path(), ec);
  }
}

void CheckpointManager::Prune() const {
  if (keep_last_ <= 0) return;
  auto all = List();
  for (size_t i = 0; i + keep_last_ < all.size(); ++i) {
    std::error_code ec;
    fs::remove_all(all[i].second, ec);
  }
}

absl::StatusOr<nlohmann::json> ReadTrainerState(const std::string& checkpoint_dir) {
  const std::string path = checkpoint_dir + "/" + kStateFile;
  ASSIGN_OR_RETURN(const std::string text, lm::ReadFile(path));
  nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object())
    return absl::DataLossError(absl::StrCat(path, ": not JSON"));
  if (!j.contains("version") || !j["version"].is_number_integer() ||
      j["version"].get<int64_t>() != kTrainerStateVersion)
    return absl::FailedPreconditionError(absl::StrCat(path, ": trainer state version ",
                                                      j.value("version", nlohmann::json()).dump(),
                                                      ", expected ", kTrainerStateVersion));
  RETURN_IF_ERROR(CheckTrainerState(j, path));
  return j;
}

absl::Status CheckTrainerState(const nlohmann::json& j, const std::string& path) {
  // Every count a resume restores, in range: a negative or impossible one would name directories
  // (step_-00006) or steer AdamW's bias correction and the non-finite guard wrongly.
  auto count = [&](const nlohmann::json& parent, const char* key, const std::string& name,
                   int64_t hi) -> absl::StatusOr<int64_t> {
    if (!parent.is_object() || !parent.contains(key) || !parent[key].is_number_integer())
      return absl::DataLossError(absl::StrCat(path, ": ", name, " is missing or not an integer"));
    const int64_t v = parent[key].get<int64_t>();
    if (v < 0 || v > hi)
      return absl::DataLossError(
          absl::StrCat(path, ": ", name, " = ", v, " is outside [0, ", hi, "]"));
    return v;
  };
  ASSIGN_OR_RETURN(const int64_t step, count(j, "step", "step", limits::kMaxSteps));
  ASSIGN_OR_RETURN(const int64_t updates, count(j, "optimizer_steps", "optimizer_steps", step));
  (void)updates;
  if (!j.contains("nonfinite"))
    return absl::DataLossError(absl::StrCat(path, ": nonfinite is missing"));
  ASSIGN_OR_RETURN(const int64_t total, count(j["nonfinite"], "total", "nonfinite.total", step));
  ASSIGN_OR_RETURN(const int64_t run,
                   count(j["nonfinite"], "consecutive", "nonfinite.consecutive", total));
  (void)run;
  if (!j.contains("rng") || !j["rng"].is_object() || !j["rng"].contains("cpu") ||
      !j["rng"]["cpu"].is_string())
    return absl::DataLossError(absl::StrCat(path, ": rng.cpu is missing or not a string"));
  if (!j.contains("data_cursor") || !j["data_cursor"].is_object())
    return absl::DataLossError(absl::StrCat(path, ": data_cursor is missing"));
  return absl::OkStatus();
}

nlohmann::json CaptureRngState() {
  nlohmann::json j;
  j["cpu"] = TensorToBase64(at::detail::getDefaultCPUGenerator().get_state());
  if (torch::cuda::is_available()) {
    j["cuda"] =
        TensorToBase64(at::globalContext().defaultGenerator(at::Device(at::kCUDA, 0)).get_state());
  }
  return j;
}

absl::Status RestoreRngState(const nlohmann::json& state) {
  auto restore = [&](const char* key, at::Generator gen) -> absl::Status {
    if (!state.contains(key) || !state[key].is_string())
      return absl::DataLossError(absl::StrCat("trainer state: rng.", key, " is not a string"));
    ASSIGN_OR_RETURN(auto bytes, Base64ToByteTensor(state[key].get<std::string>()));
    try {
      gen.set_state(bytes);
    } catch (const std::exception& e) {  // a state of another size or kind, without the backtrace
      const std::string what = e.what();
      return absl::DataLossError(absl::StrCat("trainer state: rng.", key,
                                              " is not a generator state of this build (",
                                              what.substr(0, what.find('\n')), ")"));
    }
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(restore("cpu", at::detail::getDefaultCPUGenerator()));
  if (state.contains("cuda") && torch::cuda::is_available())
    RETURN_IF_ERROR(
        restore("cuda", at::globalContext().defaultGenerator(at::Device(at::kCUDA, 0))));
  return absl::OkStatus();
}

}  // namespace trainer
