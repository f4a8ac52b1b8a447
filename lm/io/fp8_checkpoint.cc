#include "lm/io/fp8_checkpoint.h"

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "lm/util/status.h"

namespace lm {
namespace {

constexpr char kScaleSuffix[] = "_scale_inv";

std::string ShapeStr(const std::vector<int64_t>& s) {
  return absl::StrCat("[", absl::StrJoin(s, ", "), "]");
}

absl::Status TensorError(absl::StatusCode code, const SafetensorsFile& file,
                         const std::string& name, const std::string& msg) {
  return absl::Status(code, absl::StrCat(file.path(), ": tensor '", name, "': ", msg));
}

struct Located {
  const SafetensorsFile* file = nullptr;
  const TensorView* view = nullptr;
};

// The module a weight belongs to: "model.layers.0.mlp.down_proj.weight" -> "...down_proj".
std::string ModuleOf(const std::string& weight) {
  constexpr std::string_view kWeight = ".weight";
  if (weight.size() > kWeight.size() &&
      weight.compare(weight.size() - kWeight.size(), kWeight.size(), kWeight) == 0)
    return weight.substr(0, weight.size() - kWeight.size());
  return weight;
}

// The scale tensor as fp32 on the CPU (a copy: the mapping may be released), checked finite and
// non-negative.
absl::StatusOr<torch::Tensor> ReadScale(const Located& s) {
  torch::Dtype dtype;
  switch (s.view->dtype) {
    case DType::kF32:
      dtype = torch::kFloat32;
      break;
    case DType::kBF16:
      dtype = torch::kBFloat16;
      break;
    case DType::kF16:
      dtype = torch::kFloat16;
      break;
    default:
      return TensorError(absl::StatusCode::kInvalidArgument, *s.file, s.view->name,
                         absl::StrCat("an FP8 block scale of dtype ", DTypeName(s.view->dtype),
                                      " (expected F32, BF16 or F16)"));
  }
  torch::Tensor scale = torch::from_blob(const_cast<std::byte*>(s.view->data), s.view->shape,
                                         torch::TensorOptions().dtype(dtype))
                            .to(torch::kFloat32, /*non_blocking=*/false, /*copy=*/true);
  if (scale.numel() == 0) return scale;
  const int64_t bad = scale.numel() - (torch::isfinite(scale) & scale.ge(0)).sum().item<int64_t>();
  if (bad > 0)
    return TensorError(absl::StatusCode::kInvalidArgument, *s.file, s.view->name,
                       absl::StrCat(bad, " of its ", scale.numel(),
                                    " block scales are NaN, infinite or negative (a scale_inv "
                                    "is amax / 448 of its block: finite and >= 0)"));
  return scale;
}

}  // namespace

absl::StatusOr<std::shared_ptr<const Fp8Checkpoint>> Fp8Checkpoint::Scan(
    const std::vector<std::shared_ptr<const SafetensorsFile>>& files,
    const std::optional<Fp8Format>& format) {
  auto out = std::make_shared<Fp8Checkpoint>();
  std::map<std::string, Located> all;
  std::vector<Located> fp8;
  for (const auto& file : files) {
    for (const auto& [name, view] : file->tensors()) {
      all[name] = {file.get(), &view};
      if (view.dtype == DType::kF8E4M3) fp8.push_back({file.get(), &view});
    }
  }
  if (!fp8.empty() && !format)
    return TensorError(absl::StatusCode::kInvalidArgument, *fp8[0].file, fp8[0].view->name,
                       "is F8_E4M3 (an FP8 weight), but config.json has no quantization_config "
                       "to say how it is scaled");
  if (format) out->format_ = *format;
  for (const Located& w : fp8) {
    const std::string& name = w.view->name;
    const std::vector<int64_t>& shape = w.view->shape;
    if (shape.size() != 2)
      return TensorError(absl::StatusCode::kUnimplemented, *w.file, name,
                         absl::StrCat("an FP8 tensor of shape ", ShapeStr(shape),
                                      ": only 2-D weights with block scales are supported"));
    const std::string module = ModuleOf(name);
    if (!format->Converts(module))
      return TensorError(absl::StatusCode::kInvalidArgument, *w.file, name,
                         absl::StrCat("is FP8, but quantization_config.modules_to_not_convert "
                                      "leaves its module '",
                                      module, "' unquantized"));
    const std::string scale_name = name + kScaleSuffix;
    auto it = all.find(scale_name);
    if (it == all.end())
      return TensorError(
          absl::StatusCode::kNotFound, *w.file, name,
          absl::StrCat("is FP8, but the checkpoint has no '", scale_name, "' (its block scales)"));
    const std::vector<int64_t> want = {format->ScaleRows(shape[0]), format->ScaleCols(shape[1])};
    if (it->second.view->shape != want)
      return TensorError(
          absl::StatusCode::kInvalidArgument, *it->second.file, scale_name,
          absl::StrCat("has shape ", ShapeStr(it->second.view->shape), ", expected ",
                       ShapeStr(want), ": one scale per ", format->block_rows, " x ",
                       format->block_cols, " block of '", name, "' ", ShapeStr(shape)));
    ASSIGN_OR_RETURN(torch::Tensor scale, ReadScale(it->second));
    out->scales_[name] = std::move(scale);
    out->scale_names_[scale_name] = name;
  }
  for (const auto& [name, where] : all) {
    if (name.size() > sizeof(kScaleSuffix) - 1 &&
        name.compare(name.size() - (sizeof(kScaleSuffix) - 1), std::string::npos, kScaleSuffix) ==
            0 &&
        !out->scale_names_.count(name))
      return TensorError(absl::StatusCode::kInvalidArgument, *where.file, name,
                         absl::StrCat("is named as the block scales of '",
                                      name.substr(0, name.size() - (sizeof(kScaleSuffix) - 1)),
                                      "', which is not an FP8 (F8_E4M3) tensor of the checkpoint"));
  }
  return std::shared_ptr<const Fp8Checkpoint>(std::move(out));
}

const torch::Tensor* Fp8Checkpoint::ScaleOf(const std::string& weight) const {
  auto it = scales_.find(weight);
  return it == scales_.end() ? nullptr : &it->second;
}

int64_t Fp8NanCount(const torch::Tensor& fp8) {
  return fp8.view(torch::kUInt8).bitwise_and(0x7F).eq(0x7F).sum().item<int64_t>();
}

}  // namespace lm
