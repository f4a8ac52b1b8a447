// opd-ctl init-model --config CONFIG.json --out DIR [--seed N] [--std 0.02] [--tokenizer PATH]
// A random model from a Hugging Face config.json (students and teachers for tests and demos):
// every matrix ~ Normal(0, std), norms at their identity, saved as an HF model directory that
// transformers loads. With --tokenizer (a directory or a tokenizer.json) the tokenizer files are
// copied in, after checking that the tokenizer's ids fit the model's vocabulary.
#include <filesystem>
#include <iostream>

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "ctl/args.h"
#include "ctl/command.h"
#include "ctl/model_config_file.h"
#include "lm/io/hf_model_dir.h"
#include "lm/model/model.h"
#include "lm/text/tokenizer.h"
#include "lm/util/memory.h"
#include "lm/util/status.h"

namespace ctl {
namespace {

namespace fs = std::filesystem;

constexpr const char* kUsage =
    "usage: opd-ctl init-model --config CONFIG.json --out DIR [--seed N] [--std 0.02] [--tokenizer "
    "PATH]\n"
    "  --config CONFIG.json    Hugging Face model config\n"
    "  --out DIR               the model directory written\n"
    "  --seed N                initialisation seed (0)\n"
    "  --std S                 standard deviation of the matrices (0.02)\n"
    "  --tokenizer PATH        tokenizer directory or tokenizer.json to copy in\n";

constexpr const char* kTokenizerFiles[] = {
    "tokenizer.json", "tokenizer_config.json",   "vocab.json",
    "merges.txt",     "special_tokens_map.json", "chat_template.jinja"};

// The tokenizer files to copy, after checking that the tokenizer fits the model.
absl::StatusOr<std::vector<fs::path>> TokenizerFiles(const std::string& path, int64_t vocab) {
  ASSIGN_OR_RETURN(auto tokenizer, lm::Tokenizer::Load(path));
  if (tokenizer->vocab_size() > vocab)
    return absl::InvalidArgumentError(absl::StrCat("the tokenizer has ", tokenizer->vocab_size(),
                                                   " ids, more than the model's vocab_size ",
                                                   vocab));
  if (fs::is_regular_file(path)) return std::vector<fs::path>{path};
  std::vector<fs::path> files;
  for (const char* name : kTokenizerFiles) {
    if (fs::is_regular_file(fs::path(path) / name)) files.push_back(fs::path(path) / name);
  }
  return files;
}

// The host memory init-model needs, checked before the model is built: every parameter in fp32
// (each is written by InitWeights), plus a copy of the experts (SaveModel writes them unfused).
absl::Status CheckMemory(const std::string& config_path, const lm::ModelConfig& config) {
  const lm::ParameterShapes shapes = lm::ExpectedParameterShapes(config);
  lm::ParameterShapes experts;
  for (const auto& [name, shape] : shapes) {
    if (name.find(".experts.") != std::string::npos) experts[name] = shape;
  }
  const int64_t bytes = lm::ShapeBytes(shapes, 4), copies = lm::ShapeBytes(experts, 4);
  const int64_t needed = bytes > INT64_MAX - copies ? INT64_MAX : bytes + copies;
  return lm::CheckHostMemory(absl::StrCat(config_path, ": a ", config.model_type, " with ",
                                          lm::ParameterCount(shapes), " parameters in float32"),
                             needed);
}

// Builds, initialises and saves the model, returning its parameter count; what the allocator
// throws becomes a status.
absl::StatusOr<int64_t> WriteModel(const Args& args, const lm::ModelConfig& config) {
  try {
    ASSIGN_OR_RETURN(auto model, lm::CreateModel(config));
    model->InitWeights(args.Number("std", 0.02), args.Uint64("seed", 0));
    RETURN_IF_ERROR(lm::SaveModel(*model, args.Get("out")));
    int64_t params = 0;
    for (const auto& p : model->parameters()) params += p.numel();
    return params;
  } catch (const std::exception&) {
    return lm::ExceptionStatus(
        absl::StrCat(args.Get("config"), ": building a ", config.model_type, " model"));
  }
}

absl::Status InitModel(const Args& args) {
  ASSIGN_OR_RETURN(lm::ModelConfig config, ReadModelConfigFile(args.Get("config")));
  std::vector<fs::path> tokenizer_files;
  if (args.Has("tokenizer")) {
    ASSIGN_OR_RETURN(tokenizer_files, TokenizerFiles(args.Get("tokenizer"), config.vocab_size));
  }
  RETURN_IF_ERROR(CheckMemory(args.Get("config"), config));
  ASSIGN_OR_RETURN(const int64_t params, WriteModel(args, config));
  const std::string out = args.Get("out");
  for (const fs::path& f : tokenizer_files) {
    std::error_code ec;
    fs::copy_file(f, fs::path(out) / f.filename(), fs::copy_options::overwrite_existing, ec);
    if (ec) return absl::InternalError(absl::StrCat(f.string(), ": cannot copy: ", ec.message()));
  }
  std::cerr << "opd-ctl init-model: " << config.model_type << " with " << params
            << " parameters -> " << out << "\n";
  return absl::OkStatus();
}

}  // namespace

int RunInitModel(const std::vector<std::string>& words) {
  Args args;
  const FlagSpec spec = {{"config", Kind::kString},
                         {"out", Kind::kString},
                         {"seed", Kind::kUint64},
                         {"std", Kind::kNumber},
                         {"tokenizer", Kind::kString}};
  if (int rc = ParseCommandArgs("init-model", words, spec, {"config", "out"}, kUsage, &args);
      rc >= 0)
    return rc;
  const absl::Status s = InitModel(args);
  if (!s.ok()) {
    std::cerr << "opd-ctl init-model: " << s.message() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace ctl
