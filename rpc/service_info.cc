#include "rpc/service_info.h"

#include <filesystem>

#include "lm/text/tokenizer.h"
#include "lm/util/status.h"
#include "rpc/server.h"

namespace opd::rpc {

absl::StatusOr<std::string> TokenizerFingerprint(const std::string& tokenizer,
                                                 const std::string& model_dir) {
  namespace fs = std::filesystem;
  std::string path = tokenizer;
  if (path.empty()) {
    const bool has_files = fs::exists(fs::path(model_dir) / "tokenizer.json") ||
                           fs::exists(fs::path(model_dir) / "vocab.json");
    if (!has_files) return std::string("none");
    path = model_dir;
  }
  ASSIGN_OR_RETURN(auto tok, lm::Tokenizer::Load(path));
  return tok->Fingerprint();
}

opd::v1::ServiceInfo MakeServiceInfo(const ServedModel& served, const lm::ModelConfig& config) {
  std::filesystem::path dir = std::filesystem::path(served.model_dir).lexically_normal();
  if (dir.filename().empty()) dir = dir.parent_path();  // "models/x/" -> "models/x"
  opd::v1::ServiceInfo info;
  info.set_service(served.service);
  info.set_model_name(dir.filename().string());
  info.set_model_path(served.model_dir);
  info.set_architecture(config.model_type);
  info.set_vocab_size(config.vocab_size);
  info.set_tokenizer_fingerprint(served.tokenizer_fingerprint);
  info.set_max_seq_len(served.max_seq_len);
  info.set_dtype(served.dtype);
  info.set_build_version(BuildVersion());
  info.set_threads(served.threads);
  return info;
}

}  // namespace opd::rpc
