#include "lm/io/hf_model_dir.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <set>
#include <string_view>

#include <torch/torch.h>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "lm/model/arch.h"
#include "lm/model/config.h"
#include "lm/model/fp8.h"
#include "lm/model/model.h"
#include "lm/util/log.h"
#include "lm/util/memory.h"
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
    case DType::kF8E4M3:
      return torch::kFloat8_e4m3fn;
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

// Where checkpoint tensor `name` goes under `filter`; nullopt when it is skipped (an ignored name
// or prefix, or another process's expert).
absl::StatusOr<std::optional<Target>> Route(const SafetensorsFile& file, const std::string& name,
                                            const LoadFilter& filter) {
  const auto& ignored = filter.ignore_names;
  if (HasPrefix(name, filter.ignore_prefixes) ||
      std::find(ignored.begin(), ignored.end(), name) != ignored.end())
    return std::nullopt;
  const absl::StatusOr<Target> resolved = Resolve(name);
  if (!resolved.ok())
    return absl::InvalidArgumentError(
        absl::StrCat(file.path(), ": tensor '", name, "': ", resolved.status().message()));
  Target t = *resolved;
  if (t.expert >= 0 && filter.expert_row) {
    t.expert = filter.expert_row(t.param, t.expert);
    if (t.expert < 0) return std::nullopt;  // another process's expert
  }
  return t;
}

// The shape of the slice `t` fills in a parameter of shape `param` (Destination, on shapes).
absl::StatusOr<std::vector<int64_t>> SliceShape(const Target& t,
                                                const std::vector<int64_t>& param) {
  if (t.expert < 0) return param;
  if (param.size() != 3) {
    return absl::InvalidArgumentError(absl::StrCat("parameter '", t.param, "' has shape ",
                                                   ShapeStr(param),
                                                   ", not a fused [experts, rows, columns] one"));
  }
  if (t.expert >= param[0]) {
    return absl::InvalidArgumentError(
        absl::StrCat("expert index ", t.expert, " >= num_experts ", param[0]));
  }
  if (t.part == Target::kDown) return std::vector<int64_t>{param[1], param[2]};
  return std::vector<int64_t>{param[1] / 2, param[2]};
}

// A file's tensors in the order of their bytes, so that a walk over them reads sequentially.
std::vector<const TensorView*> InByteOrder(const SafetensorsFile& file) {
  std::vector<const TensorView*> order;
  for (const auto& [name, view] : file.tensors()) order.push_back(&view);
  std::sort(order.begin(), order.end(),
            [](const TensorView* a, const TensorView* b) { return a->data < b->data; });
  return order;
}

// An FP8 scale counts as loaded or ignored with its weight.
absl::Status CountScale(const SafetensorsFile& file, const std::string& scale,
                        const LoadFilter& filter, LoadReport& report) {
  const std::string weight = scale.substr(0, scale.size() - std::string_view("_scale_inv").size());
  ASSIGN_OR_RETURN(const std::optional<Target> t, Route(file, weight, filter));
  ++(t ? report.tensors_loaded : report.tensors_ignored);
  return absl::OkStatus();
}

// Checks one checkpoint tensor's header against `shapes` and records what it fills.
absl::Status CheckTensor(const SafetensorsFile& file, const TensorView& view,
                         const ParameterShapes& shapes, const LoadFilter& filter,
                         const Fp8Checkpoint* fp8, std::map<std::string, Coverage>& filled,
                         LoadReport& report) {
  if (fp8 != nullptr && fp8->IsScale(view.name)) return CountScale(file, view.name, filter, report);
  if (view.dtype == DType::kF8E4M3 && (fp8 == nullptr || fp8->ScaleOf(view.name) == nullptr))
    return absl::InvalidArgumentError(
        absl::StrCat(file.path(), ": tensor '", view.name,
                     "' is F8_E4M3 (an FP8 weight): only a model directory whose config.json has a "
                     "quantization_config loads FP8 weights"));
  ASSIGN_OR_RETURN(const std::optional<Target> t, Route(file, view.name, filter));
  if (!t) {
    ++report.tensors_ignored;
    return absl::OkStatus();
  }
  const auto it = shapes.find(t->param);
  if (it == shapes.end()) {
    return absl::InvalidArgumentError(absl::StrCat(file.path(), ": unexpected tensor '", view.name,
                                                   "' (the model has no such parameter)"));
  }
  const absl::StatusOr<std::vector<int64_t>> want = SliceShape(*t, it->second);
  if (!want.ok())
    return absl::InvalidArgumentError(
        absl::StrCat(file.path(), ": tensor '", view.name, "': ", want.status().message()));
  if (view.shape != *want) {
    return absl::InvalidArgumentError(absl::StrCat(file.path(), ": tensor '", view.name,
                                                   "' has shape ", ShapeStr(view.shape),
                                                   ", expected ", ShapeStr(*want)));
  }
  const int64_t rows = t->expert < 0 ? 0 : it->second[0];
  if (absl::Status s = filled[t->param].Add(*t, view.name, rows); !s.ok())
    return absl::InvalidArgumentError(absl::StrCat(file.path(), ": ", s.message()));
  ++report.tensors_loaded;
  return absl::OkStatus();
}

// A parameter is complete when written whole, or (fused experts) when every slice was.
absl::Status CheckComplete(const std::vector<std::shared_ptr<const SafetensorsFile>>& files,
                           const ParameterShapes& shapes,
                           const std::map<std::string, Coverage>& filled) {
  std::vector<std::string> missing;
  for (const auto& [name, shape] : shapes) {
    const auto it = filled.find(name);
    if (it == filled.end()) continue;
    const std::vector<std::string> slices = it->second.Missing();
    if (slices.empty()) continue;
    const size_t shown = std::min<size_t>(slices.size(), 4);
    missing.push_back(absl::StrCat(
        name, " (", absl::StrJoin(slices.begin(), slices.begin() + shown, ", "),
        slices.size() > shown ? absl::StrCat(", ... ", slices.size(), " slices in all") : "", ")"));
  }
  for (const auto& [name, shape] : shapes) {
    if (!filled.count(name)) missing.push_back(name);
  }
  if (missing.empty()) return absl::OkStatus();
  const size_t shown = std::min<size_t>(missing.size(), 8);
  return absl::NotFoundError(
      absl::StrCat(files.empty() ? "checkpoint" : fs::path(files[0]->path()).parent_path().string(),
                   ": ", missing.size(), " parameter(s) missing from the checkpoint: ",
                   absl::StrJoin(missing.begin(), missing.begin() + shown, ", "),
                   missing.size() > shown ? ", ..." : ""));
}

// A NaN or infinite weight would be served: every activation after it turns NaN, and nothing
// else stops it. Checked on the loaded values, so that an fp32 value beyond a bf16/fp16
// parameter's range (converted to infinity) is refused too. aminmax propagates NaN and, unlike
// isfinite(), needs no temporary the size of the tensor; the count is taken on the error path.
absl::Status CheckFinite(const SafetensorsFile& file, const std::string& name,
                         const torch::Tensor& src, const torch::Tensor& dest) {
  if (dest.numel() == 0) return absl::OkStatus();
  const auto [lo, hi] = torch::aminmax(dest);
  if (torch::isfinite(torch::stack({lo, hi})).all().item<bool>()) return absl::OkStatus();
  const int64_t bad = dest.numel() - torch::isfinite(dest).sum().item<int64_t>();
  const bool in_file = !torch::isfinite(src).all().item<bool>();
  return absl::InvalidArgumentError(absl::StrCat(
      file.path(), ": tensor '", name, "' has ", bad, " non-finite value(s) (NaN or infinity)",
      in_file ? "" : absl::StrCat(" once converted to ", c10::toString(dest.scalar_type()))));
}

// An FP8 tensor (its scales checked by Fp8Checkpoint::Scan) into `dest`, the slice of its
// parameter: as it is, with its scales into the parameter's scale buffer, when the parameter is
// kept in FP8; else dequantized into the parameter's dtype.
absl::Status LoadFp8Tensor(const SafetensorsFile& file, const std::string& name,
                           const torch::Tensor& src, const Target& t, torch::Tensor& dest,
                           const Fp8Targets& fp8, LoadReport& report) {
  const torch::Tensor* scale = fp8.checkpoint ? fp8.checkpoint->ScaleOf(name) : nullptr;
  if (scale == nullptr)  // CheckCheckpoint refuses this before the walk
    return absl::InvalidArgumentError(
        absl::StrCat(file.path(), ": tensor '", name, "': an FP8 tensor without its scales"));
  if (const int64_t nan = Fp8NanCount(src); nan > 0)
    return absl::InvalidArgumentError(absl::StrCat(file.path(), ": tensor '", name, "' has ", nan,
                                                   " NaN value(s) (FP8 bytes 0x7F / 0xFF)"));
  if (dest.scalar_type() == torch::kFloat8_e4m3fn) {
    dest.copy_(src);
    auto buffer = fp8.scales.find(t.param);
    if (buffer == fp8.scales.end())
      return absl::InternalError(absl::StrCat("parameter '", t.param, "' is FP8 without scales"));
    torch::Tensor scales = buffer->second;
    ASSIGN_OR_RETURN(torch::Tensor scale_dest, Destination(t, scales));
    scale_dest.copy_(*scale);
    ++report.fp8_kept;
    return absl::OkStatus();
  }
  const Fp8Format& f = fp8.checkpoint->format();
  DequantizeFp8Into(dest, src, *scale, f.block_rows, f.block_cols);
  ++report.fp8_dequantized;
  // Finite FP8 values times finite scales: only a product beyond an fp16 parameter's range (or
  // fp32's, for absurd scales) is not.
  if (dest.numel() > 0 && !torch::isfinite(dest).all().item<bool>())
    return absl::InvalidArgumentError(absl::StrCat(file.path(), ": tensor '", name,
                                                   "' has non-finite value(s) once dequantized to ",
                                                   c10::toString(dest.scalar_type())));
  return absl::OkStatus();
}

void AddDenseMlp(ParameterShapes& s, const std::string& p, int64_t hidden, int64_t width) {
  s[p + "gate_proj.weight"] = {width, hidden};
  s[p + "up_proj.weight"] = {width, hidden};
  s[p + "down_proj.weight"] = {hidden, width};
}

// Qwen3 attention; Qwen3-Next's (`gated`) projects a gate with the queries.
void AddAttention(ParameterShapes& s, const std::string& p, const ModelConfig& c, bool gated) {
  const int64_t q = c.num_attention_heads * c.head_dim, kv = c.num_key_value_heads * c.head_dim;
  s[p + "q_proj.weight"] = {gated ? 2 * q : q, c.hidden_size};
  s[p + "k_proj.weight"] = {kv, c.hidden_size};
  s[p + "v_proj.weight"] = {kv, c.hidden_size};
  s[p + "o_proj.weight"] = {c.hidden_size, q};
  s[p + "q_norm.weight"] = {c.head_dim};
  s[p + "k_norm.weight"] = {c.head_dim};
}

// Qwen3-Next's Gated DeltaNet (linear attention).
void AddGatedDeltaNet(ParameterShapes& s, const std::string& p, const ModelConfig& c) {
  const int64_t key_dim = c.linear_num_key_heads * c.linear_key_head_dim;
  const int64_t value_dim = c.linear_num_value_heads * c.linear_value_head_dim;
  s[p + "in_proj_qkvz.weight"] = {2 * key_dim + 2 * value_dim, c.hidden_size};
  s[p + "in_proj_ba.weight"] = {2 * c.linear_num_value_heads, c.hidden_size};
  s[p + "conv1d.weight"] = {2 * key_dim + value_dim, 1, c.linear_conv_kernel_dim};
  s[p + "dt_bias"] = {c.linear_num_value_heads};
  s[p + "A_log"] = {c.linear_num_value_heads};
  s[p + "norm.weight"] = {c.linear_value_head_dim};
  s[p + "out_proj.weight"] = {c.hidden_size, value_dim};
}

// The sparse MoE block: router over all experts, this process's experts fused; Qwen3-Next's
// (`shared`) adds its shared expert and that expert's gate.
void AddMoe(ParameterShapes& s, const std::string& p, const ModelConfig& c, bool shared) {
  const int64_t e = c.LocalExperts(), h = c.hidden_size, i = c.moe_intermediate_size;
  s[p + "gate.weight"] = {c.num_experts, h};
  s[p + "experts.gate_up_proj"] = {e, 2 * i, h};
  s[p + "experts.down_proj"] = {e, h, i};
  if (!shared) return;
  AddDenseMlp(s, p + "shared_expert.", h, c.shared_expert_intermediate_size);
  s[p + "shared_expert_gate.weight"] = {1, h};
}

int64_t SaturatingAdd(int64_t a, int64_t b) {
  return a > std::numeric_limits<int64_t>::max() - b ? std::numeric_limits<int64_t>::max() : a + b;
}

}  // namespace

ParameterShapes ExpectedParameterShapes(const ModelConfig& c) {
  const Architecture* arch = FindArchitecture(c.model_type);
  const bool next = arch != nullptr && arch->hybrid_attention;
  ParameterShapes s;
  s["model.embed_tokens.weight"] = {c.vocab_size, c.hidden_size};
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    s[p + "input_layernorm.weight"] = {c.hidden_size};
    s[p + "post_attention_layernorm.weight"] = {c.hidden_size};
    if (c.IsFullAttentionLayer(i)) {
      AddAttention(s, p + "self_attn.", c, /*gated=*/next);
    } else {
      AddGatedDeltaNet(s, p + "linear_attn.", c);
    }
    if (c.IsMoeLayer(i)) {
      AddMoe(s, p + "mlp.", c, /*shared=*/next);
    } else {
      AddDenseMlp(s, p + "mlp.", c.hidden_size, c.intermediate_size);
    }
  }
  s["model.norm.weight"] = {c.hidden_size};
  if (!c.tie_word_embeddings) s["lm_head.weight"] = {c.vocab_size, c.hidden_size};
  return s;
}

int64_t ParameterCount(const ParameterShapes& shapes) {
  int64_t n = 0;
  for (const auto& [name, shape] : shapes) {
    int64_t numel = 1;
    // Each size is bounded by the config's checks; the product of a header's dims is not.
    for (int64_t d : shape) {
      if (d != 0 && numel > std::numeric_limits<int64_t>::max() / d)
        return std::numeric_limits<int64_t>::max();
      numel *= d;
    }
    n = SaturatingAdd(n, numel);
  }
  return n;
}

int64_t ShapeBytes(const ParameterShapes& shapes, int64_t element_size) {
  const int64_t n = ParameterCount(shapes);
  if (n > std::numeric_limits<int64_t>::max() / element_size)
    return std::numeric_limits<int64_t>::max();
  return n * element_size;
}

LoadFilter ModelLoadFilter(const ModelConfig& config) {
  LoadFilter filter;
  // CausalLM::TiedAliases(), known before the model exists.
  if (config.tie_word_embeddings) filter.ignore_names = {"lm_head.weight"};
  if (const Architecture* arch = FindArchitecture(config.model_type))
    filter.ignore_prefixes = arch->ignored_prefixes;
  return filter;
}

absl::StatusOr<LoadReport> CheckCheckpoint(
    const std::vector<std::shared_ptr<const SafetensorsFile>>& files, const ParameterShapes& shapes,
    const LoadFilter& filter) {
  const Fp8Checkpoint* fp8 = filter.fp8.checkpoint.get();
  LoadReport report;
  std::map<std::string, Coverage> filled;
  for (const auto& file : files) {
    for (const TensorView* view : InByteOrder(*file))
      RETURN_IF_ERROR(CheckTensor(*file, *view, shapes, filter, fp8, filled, report));
  }
  RETURN_IF_ERROR(CheckComplete(files, shapes, filled));
  return report;
}

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
    for (const TensorView* view : InByteOrder(*file)) {
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
  const Fp8Targets& fp8 = filter.fp8;
  ParameterShapes shapes;
  for (const auto& [name, p] : params) shapes[name] = p.sizes().vec();
  // Names, shapes and completeness come from the headers: a checkpoint that does not fit is
  // refused before a byte of it is read, and the walk below only copies.
  ASSIGN_OR_RETURN(LoadReport report, CheckCheckpoint(files, shapes, filter));
  RETURN_IF_ERROR(ForEachCheckpointTensor(
      files,
      [&](const SafetensorsFile& file, const std::string& name,
          const torch::Tensor& src) -> absl::Status {
        if (fp8.checkpoint && fp8.checkpoint->IsScale(name)) return absl::OkStatus();
        ASSIGN_OR_RETURN(const std::optional<Target> t, Route(file, name, filter));
        if (!t) return absl::OkStatus();
        absl::StatusOr<torch::Tensor> dest = Destination(*t, params.at(t->param));
        if (!dest.ok())
          return absl::InvalidArgumentError(
              absl::StrCat(file.path(), ": tensor '", name, "': ", dest.status().message()));
        if (src.scalar_type() == torch::kFloat8_e4m3fn)
          return LoadFp8Tensor(file, name, src, *t, *dest, fp8, report);
        // Converts to the parameter's dtype and places it on its device: a CPU-side temporary of
        // this one tensor at most (LibTorch converts on the host before a host-to-device copy).
        dest->copy_(src);
        return CheckFinite(file, name, src, *dest);
      }));
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

absl::Status ExceptionStatus(const std::string& what) {
  try {
    throw;
  } catch (const c10::OutOfMemoryError& e) {
    return absl::ResourceExhaustedError(
        absl::StrCat(what, ": out of memory: ", e.what_without_backtrace()));
  } catch (const std::bad_alloc& e) {
    return absl::ResourceExhaustedError(absl::StrCat(what, ": out of memory (", e.what(), ")"));
  } catch (const c10::Error& e) {
    // The CPU allocator reports a failed allocation as a plain c10::Error (an enforce failure
    // naming itself), not as OutOfMemoryError as the CUDA one does.
    const std::string message = e.what_without_backtrace();
    if (message.find("DefaultCPUAllocator") != std::string::npos)
      return absl::ResourceExhaustedError(absl::StrCat(what, ": out of memory: ", message));
    return absl::InternalError(absl::StrCat(what, ": ", message));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(what, ": ", e.what()));
  }
}

// ---- model-level load/save (declared in lm/model/model.h) ----

namespace {

absl::Status CheckLoadMemory(const std::string& dir, const ModelConfig& config,
                             const ParameterShapes& shapes, const LoadOptions& opts) {
  // Only a model on the host is held in host memory: a device's own allocator reports what does
  // not fit there (as RESOURCE_EXHAUSTED, through CreateModel), and the host then holds about one
  // tensor of the checkpoint at a time.
  if (!opts.device.is_cpu()) return absl::OkStatus();
  const int64_t bytes = ShapeBytes(shapes, c10::elementSize(opts.dtype));
  return CheckHostMemory(
      absl::StrCat(dir, ": ", config.model_type, " with ", ParameterCount(shapes),
                   " parameters as ", c10::toString(opts.dtype)),
      bytes);
}

// Parameters the load may keep in FP8: those every checkpoint tensor of which (under `filter`)
// is FP8, but the LM head (read as a matrix, not only through a GEMM). Whether a parameter's
// module can hold FP8 is MakeFp8Holder's to say.
std::set<std::string> Fp8Parameters(
    const std::vector<std::shared_ptr<const SafetensorsFile>>& files, const Fp8Checkpoint& fp8,
    const LoadFilter& filter) {
  std::map<std::string, bool> all_fp8;
  for (const auto& file : files) {
    for (const auto& [name, view] : file->tensors()) {
      if (fp8.IsScale(name)) continue;
      const absl::StatusOr<std::optional<Target>> t = Route(*file, name, filter);
      if (!t.ok() || !t->has_value()) continue;  // CheckCheckpoint reported errors already
      auto [it, fresh] = all_fp8.emplace((*t)->param, true);
      it->second = it->second && view.dtype == DType::kF8E4M3;
    }
  }
  std::set<std::string> out;
  for (const auto& [param, fp8_only] : all_fp8)
    if (fp8_only && param != "lm_head.weight") out.insert(param);
  return out;
}

// Whether the load keeps the FP8 weights of `fp8` in FP8 on `opts.device`, or an error
// (kKeep where that cannot be).
absl::StatusOr<bool> KeepFp8(const std::string& dir, const Fp8Checkpoint& fp8,
                             const LoadOptions& opts) {
  if (fp8.empty() || opts.fp8 == Fp8Weights::kDequantize) return false;
  const Fp8Format& f = fp8.format();
  const bool gemm_blocks = f.block_rows == kFp8Block && f.block_cols == kFp8Block;
  const bool kernels = Fp8KernelsFor(opts.device) != nullptr;
  if (opts.fp8 == Fp8Weights::kAuto) return gemm_blocks && kernels && opts.device.is_cuda();
  if (!gemm_blocks)
    return absl::UnimplementedError(absl::StrCat(
        dir, ": weight_block_size [", f.block_rows, ", ", f.block_cols,
        "]: FP8 weights can only be kept in FP8 with 128 x 128 blocks (load them dequantized)"));
  if (!kernels)
    return absl::FailedPreconditionError(
        absl::StrCat(dir, ": FP8 weights cannot be kept in FP8 on ", opts.device.str(),
                     ": no FP8 GEMMs run there (CUDA needs compute capability 8.9 or newer)"));
  return true;
}

// The model for `config` with every parameter an uninitialised tensor of `placement`, but those
// of `fp8` that their modules can hold in FP8 (MakeFp8Holder): those are FP8, and `scales`
// receives each one's scale buffer.
absl::StatusOr<std::shared_ptr<CausalLM>> CreateModelWithFp8(
    const ModelConfig& config, const LoadOptions& placement, const std::set<std::string>& fp8,
    std::map<std::string, torch::Tensor>* scales) {
  try {
    ASSIGN_OR_RETURN(auto model, CreateModel(config));
    // The constructors allocate fp32 host tensors without writing them (no page is touched, so
    // they cost address space, not memory); each is replaced at once by an uninitialised tensor
    // of the target dtype on the target device, as Module::to() would do after copying.
    torch::NoGradGuard no_grad;
    std::set<std::string> held;
    for (const auto& module : model->named_modules("", /*include_self=*/false)) {
      for (const auto& p : module.value()->named_parameters(/*recurse=*/false)) {
        const std::string name = absl::StrCat(module.key(), ".", p.key());
        if (!fp8.count(name) || !MakeFp8Holder(*module.value(), p.key(), placement.device))
          continue;
        held.insert(name);
        (*scales)[name] = module.value()->named_buffers(false)[p.key() + "_scale_inv"];
      }
    }
    const auto options = torch::TensorOptions().dtype(placement.dtype).device(placement.device);
    for (auto& p : model->named_parameters())
      if (!held.count(p.key())) p.value().set_data(torch::empty(p.value().sizes(), options));
    return model;
  } catch (const std::exception&) {
    return ExceptionStatus(absl::StrCat("allocating a ", config.model_type, " model of ",
                                        ParameterCount(ExpectedParameterShapes(config)),
                                        " parameters as ", c10::toString(placement.dtype), " on ",
                                        placement.device.str()));
  }
}

}  // namespace

absl::StatusOr<std::shared_ptr<CausalLM>> LoadCheckpoint(const std::string& dir,
                                                         const ModelConfig& config,
                                                         const LoadOptions& opts,
                                                         const LoadFilter& given,
                                                         LoadReport* report) {
  // Everything that can refuse the load does so from the headers and the config, before the
  // model is allocated: a config that disagrees with its checkpoint (hidden_size 1e6 over a small
  // model) would otherwise ask for its absurd size first.
  const ParameterShapes shapes = ExpectedParameterShapes(config);
  ASSIGN_OR_RETURN(auto files, OpenCheckpointFiles(dir));
  LoadFilter filter = given;
  Fp8Targets& fp8 = filter.fp8;
  ASSIGN_OR_RETURN(fp8.checkpoint, Fp8Checkpoint::Scan(files, config.fp8));
  RETURN_IF_ERROR(CheckCheckpoint(files, shapes, filter).status());
  RETURN_IF_ERROR(CheckLoadMemory(dir, config, shapes, opts));
  ASSIGN_OR_RETURN(const bool keep_fp8, KeepFp8(dir, *fp8.checkpoint, opts));
  if (!keep_fp8 && !fp8.checkpoint->empty() && opts.device.is_cuda() &&
      opts.fp8 == Fp8Weights::kAuto)
    log::Warn(absl::StrCat(dir, ": FP8 weights dequantized to ", c10::toString(opts.dtype), " on ",
                           opts.device.str(),
                           ": its FP8 GEMMs need compute capability 8.9 and 128 x 128 blocks"));
  // The parameters exist only in the target dtype (or FP8) on the target device; each checkpoint
  // tensor is converted and placed as it is read.
  absl::StatusOr<std::shared_ptr<CausalLM>> model = CreateModelWithFp8(
      config, opts,
      keep_fp8 ? Fp8Parameters(files, *fp8.checkpoint, filter) : std::set<std::string>(),
      &fp8.scales);
  if (!model.ok())
    return absl::Status(model.status().code(), absl::StrCat(dir, ": ", model.status().message()));
  std::map<std::string, torch::Tensor> params;
  for (auto& p : (*model)->named_parameters()) params[p.key()] = p.value();
  absl::StatusOr<LoadReport> loaded;
  try {
    loaded = LoadParameters(files, params, filter);
  } catch (const std::exception&) {
    return ExceptionStatus(absl::StrCat(dir, ": loading the checkpoint"));
  }
  if (!loaded.ok()) return loaded.status();
  if (report != nullptr) *report = *loaded;
  return model;
}

absl::StatusOr<std::shared_ptr<CausalLM>> LoadModel(const std::string& dir,
                                                    const LoadOptions& opts) {
  ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(dir));
  LoadReport report;
  ASSIGN_OR_RETURN(auto model, LoadCheckpoint(dir, config, opts, ModelLoadFilter(config), &report));
  std::string fp8;
  if (report.fp8_kept + report.fp8_dequantized > 0)
    fp8 = absl::StrCat(" (FP8: ", report.fp8_kept, " kept in FP8, ", report.fp8_dequantized,
                       " dequantized)");
  log::Info(absl::StrCat("loaded ", dir, " (", config.model_type, "): ", report.tensors_loaded,
                         " tensors", fp8, ", ", report.tensors_ignored, " ignored, as ",
                         c10::toString(opts.dtype), " on ", opts.device.str()));
  return model;
}

absl::StatusOr<std::shared_ptr<CausalLM>> CreateModel(const ModelConfig& config,
                                                      const LoadOptions& placement) {
  std::map<std::string, torch::Tensor> none;
  return CreateModelWithFp8(config, placement, {}, &none);
}

absl::Status SaveModel(CausalLM& model, const std::string& dir, const SaveOptions& opts) {
  std::map<std::string, torch::Tensor> params;
  for (auto& p : model.named_parameters()) {
    if (p.value().scalar_type() == torch::kFloat8_e4m3fn)
      return absl::FailedPreconditionError(absl::StrCat(
          "saving to ", dir, ": parameter '", p.key(),
          "' holds FP8 weights (kept from an FP8 checkpoint); load the model dequantized "
          "(Fp8Weights::kDequantize) to save it"));
    params[p.key()] = p.value();
  }
  RETURN_IF_ERROR(SaveParameters(dir, params, opts.dtype, opts.max_shard_bytes));
  nlohmann::json cfg = model.config().raw;
  // The weights are written dequantized: the checkpoint is no longer an FP8 one.
  cfg.erase("quantization_config");
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
