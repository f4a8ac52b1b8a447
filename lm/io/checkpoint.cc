#include "lm/io/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string_view>

#include <torch/torch.h>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "lm/model/arch.h"
#include "lm/model/config.h"
#include "lm/model/model.h"
#include "lm/util/log.h"
#include "lm/util/status.h"
#include "nlohmann/json.hpp"

namespace lm {
namespace fs = std::filesystem;
namespace {

torch::Dtype TorchDType(DType d) {
  switch (d) {
    case DType::kF32:
      return torch::kFloat32;
    case DType::kF16:
      return torch::kFloat16;
    case DType::kBF16:
      return torch::kBFloat16;
  }
  return torch::kFloat32;
}

absl::StatusOr<DType> FileDType(torch::Dtype d) {
  if (d == torch::kFloat32) return DType::kF32;
  if (d == torch::kFloat16) return DType::kF16;
  if (d == torch::kBFloat16) return DType::kBF16;
  return absl::InvalidArgumentError(absl::StrCat("cannot save dtype ", c10::toString(d)));
}

std::string ShapeStr(c10::IntArrayRef s) {
  return absl::StrCat("[", absl::StrJoin(s, ", "), "]");
}

// Where one checkpoint tensor goes: a whole parameter, or one expert's rows of a fused one.
struct Target {
  std::string param;
  int64_t expert = -1;  // >= 0: per-expert slice
  enum Part { kWhole, kGate, kUp, kDown } part = kWhole;
};

const char* PartName(Target::Part part) {
  switch (part) {
    case Target::kGate:
      return "gate_proj";
    case Target::kUp:
      return "up_proj";
    case Target::kDown:
      return "down_proj";
    case Target::kWhole:
      break;
  }
  return "whole";
}

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// `...mlp.experts.E.{gate,up,down}_proj.weight` -> the fused parameter and expert E; any other
// name -> the parameter of that name. Parsed by hand: the names come from files, and a regex
// over a long hostile name recurses deeply. An index that does not fit int64 is an error.
absl::StatusOr<Target> Resolve(const std::string& name) {
  static constexpr std::string_view kExperts = ".mlp.experts.";
  for (const Target::Part part : {Target::kGate, Target::kUp, Target::kDown}) {
    const std::string suffix = absl::StrCat(".", PartName(part), ".weight");
    if (!EndsWith(name, suffix)) continue;
    const std::string rest = name.substr(0, name.size() - suffix.size());
    size_t digits = 0;
    while (digits < rest.size() && absl::ascii_isdigit(rest[rest.size() - 1 - digits])) ++digits;
    const size_t head = rest.size() - digits;  // rest[0, head) ends with ".mlp.experts."
    if (digits == 0 || !EndsWith(std::string_view(rest).substr(0, head), kExperts)) break;
    const std::string index = rest.substr(head);
    int64_t expert = 0;
    if (!absl::SimpleAtoi(index, &expert))
      return absl::InvalidArgumentError(absl::StrCat("expert index ", index, " is out of range"));
    const std::string base = rest.substr(0, head - 1);  // "...mlp.experts"
    if (part == Target::kDown) return Target{base + ".down_proj", expert, part};
    return Target{base + ".gate_up_proj", expert, part};
  }
  return Target{name};
}

// Which checkpoint tensor filled each part of a parameter: the whole of it, or (fused experts)
// each expert's slices. Remembering names, not counts, is what lets a duplicate be told apart
// from the slice it hides.
class Coverage {
 public:
  // Records that `tensor` filled `t` of a parameter with `num_experts` rows; an error naming both
  // tensors when that part was filled before.
  absl::Status Add(const Target& t, const std::string& tensor, int64_t num_experts) {
    if (t.expert < 0) {
      if (!whole_.empty())
        return Duplicate(tensor, whole_, absl::StrCat("parameter '", t.param, "'"));
      if (!slices_.empty())
        return Duplicate(tensor, FirstSlice(), absl::StrCat("parameter '", t.param, "'"));
      whole_ = tensor;
      return absl::OkStatus();
    }
    if (!whole_.empty())
      return Duplicate(tensor, whole_, absl::StrCat("parameter '", t.param, "'"));
    parts_ = t.part == Target::kDown ? 1 : 2;
    slices_.resize(static_cast<size_t>(num_experts * parts_));
    std::string& slot = slices_[static_cast<size_t>(t.expert * parts_ + (t.part == Target::kUp))];
    if (!slot.empty())
      return Duplicate(
          tensor, slot,
          absl::StrCat("expert ", t.expert, " ", PartName(t.part), " of '", t.param, "'"));
    slot = tensor;
    return absl::OkStatus();
  }

  // The slices nobody filled, e.g. "expert 5 gate_proj"; empty when the parameter is complete.
  std::vector<std::string> Missing() const {
    std::vector<std::string> missing;
    if (!whole_.empty()) return missing;
    for (size_t i = 0; i < slices_.size(); ++i) {
      if (!slices_[i].empty()) continue;
      const Target::Part part =
          parts_ == 1 ? Target::kDown : (i % 2 == 0 ? Target::kGate : Target::kUp);
      missing.push_back(absl::StrCat("expert ", i / parts_, " ", PartName(part)));
    }
    return missing;
  }

 private:
  static absl::Status Duplicate(const std::string& tensor, const std::string& before,
                                const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", tensor, "' fills ", what,
                                                   ", which tensor '", before,
                                                   "' already filled (duplicate)"));
  }
  std::string FirstSlice() const {
    for (const std::string& s : slices_) {
      if (!s.empty()) return s;
    }
    return "";
  }

  std::string whole_;
  std::vector<std::string> slices_;  // expert * parts_ + (up ? 1 : 0) -> tensor name
  int64_t parts_ = 1;
};

// The slice of `param` that `t` fills; nullopt with an error when shapes disagree.
absl::StatusOr<torch::Tensor> Destination(const Target& t, torch::Tensor& param) {
  if (t.expert < 0) return param;
  if (param.dim() != 3) {
    return absl::InvalidArgumentError(absl::StrCat("parameter '", t.param, "' has shape ",
                                                   ShapeStr(param.sizes()),
                                                   ", not a fused [experts, rows, columns] one"));
  }
  if (t.expert >= param.size(0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("expert index ", t.expert, " >= num_experts ", param.size(0)));
  }
  auto row = param[t.expert];
  if (t.part == Target::kDown) return row;
  const int64_t I = row.size(0) / 2;
  return row.narrow(0, t.part == Target::kGate ? 0 : I, I);
}

bool HasPrefix(const std::string& s, const std::vector<std::string>& prefixes) {
  for (const auto& p : prefixes) {
    if (s.rfind(p, 0) == 0) return true;
  }
  return false;
}

}  // namespace

absl::StatusOr<std::vector<std::shared_ptr<const SafetensorsFile>>> OpenCheckpointFiles(
    const std::string& dir) {
  ASSIGN_OR_RETURN(const std::vector<std::string> paths, CheckpointFilePaths(dir));
  std::vector<std::shared_ptr<const SafetensorsFile>> files;
  for (const auto& path : paths) {
    ASSIGN_OR_RETURN(auto f, SafetensorsFile::Open(path));
    files.push_back(std::move(f));
  }
  return files;
}

torch::Tensor TensorFromView(const TensorView& view, std::shared_ptr<const SafetensorsFile> file) {
  return torch::from_blob(
      const_cast<std::byte*>(view.data), view.shape, [file](void*) {},
      torch::TensorOptions().dtype(TorchDType(view.dtype)));
}

absl::Status ForEachCheckpointTensor(
    const std::vector<std::shared_ptr<const SafetensorsFile>>& files,
    const CheckpointTensorFn& fn) {
  torch::NoGradGuard no_grad;
  for (const auto& file : files) {
    std::vector<const TensorView*> order;
    for (const auto& [name, view] : file->tensors()) order.push_back(&view);
    std::sort(order.begin(), order.end(),
              [](const TensorView* a, const TensorView* b) { return a->data < b->data; });
    for (const TensorView* view : order) {
      const absl::Status st = fn(*file, view->name, TensorFromView(*view, file));
      file->ReleasePages(*view);
      RETURN_IF_ERROR(st);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<LoadReport> LoadParameters(
    const std::vector<std::shared_ptr<const SafetensorsFile>>& files,
    std::map<std::string, torch::Tensor>& params, const std::vector<std::string>& ignore_names,
    const std::vector<std::string>& ignore_prefixes) {
  LoadFilter filter;
  filter.ignore_names = ignore_names;
  filter.ignore_prefixes = ignore_prefixes;
  return LoadParameters(files, params, filter);
}

absl::StatusOr<LoadReport> LoadParameters(
    const std::vector<std::shared_ptr<const SafetensorsFile>>& files,
    std::map<std::string, torch::Tensor>& params, const LoadFilter& filter) {
  torch::NoGradGuard no_grad;
  LoadReport report;
  std::map<std::string, Coverage> filled;
  const auto& ignore_names = filter.ignore_names;
  RETURN_IF_ERROR(ForEachCheckpointTensor(
      files,
      [&](const SafetensorsFile& file, const std::string& name,
          const torch::Tensor& src) -> absl::Status {
        if (HasPrefix(name, filter.ignore_prefixes) ||
            std::find(ignore_names.begin(), ignore_names.end(), name) != ignore_names.end()) {
          ++report.tensors_ignored;
          return absl::OkStatus();
        }
        const absl::StatusOr<Target> resolved = Resolve(name);
        if (!resolved.ok())
          return absl::InvalidArgumentError(
              absl::StrCat(file.path(), ": tensor '", name, "': ", resolved.status().message()));
        Target t = *resolved;
        if (t.expert >= 0 && filter.expert_row) {
          t.expert = filter.expert_row(t.param, t.expert);
          if (t.expert < 0) {  // another process's expert
            ++report.tensors_ignored;
            return absl::OkStatus();
          }
        }
        auto it = params.find(t.param);
        if (it == params.end()) {
          return absl::InvalidArgumentError(absl::StrCat(file.path(), ": unexpected tensor '", name,
                                                         "' (the model has no such parameter)"));
        }
        auto dest = Destination(t, it->second);
        if (!dest.ok())
          return absl::InvalidArgumentError(
              absl::StrCat(file.path(), ": tensor '", name, "': ", dest.status().message()));
        if (src.sizes() != dest->sizes()) {
          return absl::InvalidArgumentError(absl::StrCat(file.path(), ": tensor '", name,
                                                         "' has shape ", ShapeStr(src.sizes()),
                                                         ", expected ", ShapeStr(dest->sizes())));
        }
        const int64_t rows = t.expert < 0 ? 0 : it->second.size(0);
        if (absl::Status s = filled[t.param].Add(t, name, rows); !s.ok())
          return absl::InvalidArgumentError(absl::StrCat(file.path(), ": ", s.message()));
        // Converts to the parameter's dtype and places it on its device: a CPU-side temporary of
        // this one tensor at most (LibTorch converts on the host before a host-to-device copy).
        dest->copy_(src);
        ++report.tensors_loaded;
        return absl::OkStatus();
      }));
  // A parameter is complete when written whole, or (fused experts) when every slice was.
  std::vector<std::string> missing;
  for (auto& [name, p] : params) {
    const auto it = filled.find(name);
    if (it == filled.end()) continue;
    const std::vector<std::string> slices = it->second.Missing();
    if (slices.empty()) continue;
    const size_t shown = std::min<size_t>(slices.size(), 4);
    missing.push_back(absl::StrCat(
        name, " (", absl::StrJoin(slices.begin(), slices.begin() + shown, ", "),
        slices.size() > shown ? absl::StrCat(", ... ", slices.size(), " slices in all") : "", ")"));
  }
  for (auto& [name, p] : params) {
    if (!filled.count(name)) missing.push_back(name);
  }
  if (!missing.empty()) {
    const size_t shown = std::min<size_t>(missing.size(), 8);
    return absl::NotFoundError(absl::StrCat(
        files.empty() ? "checkpoint" : fs::path(files[0]->path()).parent_path().string(), ": ",
        missing.size(), " parameter(s) missing from the checkpoint: ",
        absl::StrJoin(missing.begin(), missing.begin() + shown, ", "),
        missing.size() > shown ? ", ..." : ""));
  }
  return report;
}

absl::Status SaveParameters(const std::string& dir,
                            const std::map<std::string, torch::Tensor>& params, torch::Dtype dtype,
                            int64_t max_shard_bytes) {
  ASSIGN_OR_RETURN(DType file_dtype, FileDType(dtype));
  // Unfuse experts and convert; the tensors stay alive in `owned` until written.
  std::vector<std::pair<std::string, torch::Tensor>> owned;
  for (const auto& [name, p] : params) {
    auto t = p.detach().to(torch::kCPU, dtype).contiguous();
    const std::string gu = ".experts.gate_up_proj", dn = ".experts.down_proj";
    auto ends_with = [&](const std::string& suffix) {
      return name.size() >= suffix.size() &&
             name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
    };
    if (ends_with(gu)) {
      const std::string base = name.substr(0, name.size() - gu.size()) + ".experts.";
      const int64_t I = t.size(1) / 2;
      for (int64_t e = 0; e < t.size(0); ++e) {
        owned.emplace_back(absl::StrCat(base, e, ".gate_proj.weight"),
                           t[e].narrow(0, 0, I).contiguous());
        owned.emplace_back(absl::StrCat(base, e, ".up_proj.weight"),
                           t[e].narrow(0, I, I).contiguous());
      }
    } else if (ends_with(dn)) {
      const std::string base = name.substr(0, name.size() - dn.size()) + ".experts.";
      for (int64_t e = 0; e < t.size(0); ++e) {
        owned.emplace_back(absl::StrCat(base, e, ".down_proj.weight"), t[e].contiguous());
      }
    } else {
      owned.emplace_back(name, t);
    }
  }
  std::sort(owned.begin(), owned.end(), [](auto& a, auto& b) { return a.first < b.first; });

  // Greedy sharding in name order.
  std::vector<std::vector<TensorToWrite>> shards(1);
  int64_t shard_bytes = 0, total_bytes = 0;
  for (const auto& [name, t] : owned) {
    const int64_t nb = t.numel() * t.element_size();
    if (shard_bytes > 0 && shard_bytes + nb > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(
        {name, file_dtype, t.sizes().vec(), t.data_ptr(), static_cast<size_t>(nb)});
    shard_bytes += nb;
    total_bytes += nb;
  }
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    return absl::InternalError(absl::StrCat(dir, ": cannot create directory: ", ec.message()));
  const std::map<std::string, std::string> meta = {{"format", "pt"}};
  if (shards.size() == 1) return WriteSafetensors(dir + "/model.safetensors", shards[0], meta);

  nlohmann::json index = {{"metadata", {{"total_size", total_bytes}}},
                          {"weight_map", nlohmann::json::object()}};
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string file =
        absl::StrFormat("model-%05d-of-%05d.safetensors", i + 1, shards.size());
    RETURN_IF_ERROR(WriteSafetensors(dir + "/" + file, shards[i], meta));
    for (const auto& t : shards[i]) index["weight_map"][t.name] = file;
  }
  std::ofstream out(dir + "/model.safetensors.index.json");
  out << index.dump(2) << "\n";
  if (!out)
    return absl::InternalError(absl::StrCat(dir, "/model.safetensors.index.json: write failed"));
  return absl::OkStatus();
}

// ---- model-level load/save (declared in lm/model/model.h) ----

absl::StatusOr<std::shared_ptr<CausalLM>> LoadModel(const std::string& dir,
                                                    const LoadOptions& opts) {
  ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(dir));
  // The parameters exist only in the target dtype on the target device; each checkpoint tensor
  // is converted and placed as it is read.
  ASSIGN_OR_RETURN(auto model, CreateModel(config, opts));
  ASSIGN_OR_RETURN(auto files, OpenCheckpointFiles(dir));
  std::map<std::string, torch::Tensor> params;
  for (auto& p : model->named_parameters()) params[p.key()] = p.value();
  const std::vector<std::string>& ignore_prefixes =
      FindArchitecture(config.model_type)->ignored_prefixes;  // known: CreateModel succeeded
  ASSIGN_OR_RETURN(LoadReport report,
                   LoadParameters(files, params, model->TiedAliases(), ignore_prefixes));
  log::Info(absl::StrCat("loaded ", dir, " (", config.model_type, "): ", report.tensors_loaded,
                         " tensors from ", files.size(), " file(s), ", report.tensors_ignored,
                         " ignored, as ", c10::toString(opts.dtype), " on ", opts.device.str()));
  return model;
}

absl::StatusOr<std::shared_ptr<CausalLM>> CreateModel(const ModelConfig& config,
                                                      const LoadOptions& placement) {
  ASSIGN_OR_RETURN(auto model, CreateModel(config));
  // The constructors allocate fp32 host tensors without writing them (no page is touched, so
  // they cost address space, not memory); each is replaced at once by an uninitialised tensor of
  // the target dtype on the target device, as Module::to() would do after copying.
  torch::NoGradGuard no_grad;
  const auto options = torch::TensorOptions().dtype(placement.dtype).device(placement.device);
  for (auto& p : model->parameters()) p.set_data(torch::empty(p.sizes(), options));
  return model;
}

absl::Status SaveModel(CausalLM& model, const std::string& dir, const SaveOptions& opts) {
  std::map<std::string, torch::Tensor> params;
  for (auto& p : model.named_parameters()) params[p.key()] = p.value();
  RETURN_IF_ERROR(SaveParameters(dir, params, opts.dtype, opts.max_shard_bytes));
  nlohmann::json cfg = model.config().raw;
  cfg["dtype"] = opts.dtype == torch::kFloat32    ? "float32"
                 : opts.dtype == torch::kBFloat16 ? "bfloat16"
                                                  : "float16";
  if (!cfg.contains("architectures")) {
    cfg["architectures"] = {FindArchitecture(model.config().model_type)->hf_class};
  }
  const std::string path = dir + "/config.json";
  std::ofstream out(path + ".tmp");
  out << cfg.dump(2) << "\n";
  out.close();
  if (!out) return absl::InternalError(absl::StrCat(path, ": write failed"));
  fs::rename(path + ".tmp", path);
  return absl::OkStatus();
}

}  // namespace lm
