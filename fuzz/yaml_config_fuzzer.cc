// The trainer's YAML configs (lm/util/config.h): any input is a config file, optionally
// followed by a NUL byte and --set overrides, one per line. Parsing and decoding either fail with a
// status or give a config that survives a round trip: encoding it and decoding the text again
// succeeds and encodes to the same text. (Only the torch-free layer: lm/util/config.cc and
// the config structs; ValidateOpdConfig needs LibTorch and is not fuzzed.)
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>

#include "fuzz/fuzz_util.h"
#include "lm/util/config.h"
#include "trainer/opd/opd_config.h"
#include "trainer/sft/sft_config.h"

namespace {

template <class T>
void RoundTrip(const YAML::Node& root) {
  T config;
  if (!lm::DecodeConfig(root, &config).ok()) return;
  const std::string text = lm::EncodeConfig(config);
  auto again = lm::ParseYaml(text, "encoded");
  FUZZ_CHECK(again.ok(), std::string(again.status().message()) + "\n" + text);
  T decoded;
  const absl::Status s = lm::DecodeConfig(*again, &decoded);
  FUZZ_CHECK(s.ok(), std::string(s.message()) + "\n" + text);
  FUZZ_CHECK(lm::EncodeConfig(decoded) == text, "encode(decode(encode(c))) != encode(c)\n" + text);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  auto root = lm::ParseYaml(input.substr(0, nul), "fuzz.yaml");
  if (!root.ok()) {
    fuzz::CheckNamed(root.status(), "fuzz.yaml");
    return 0;
  }
  if (nul != std::string::npos) {
    std::istringstream overrides(input.substr(nul + 1));
    std::string line;
    while (std::getline(overrides, line)) (void)lm::ApplyOverride(*root, line);
  }
  RoundTrip<trainer::SftConfig>(*root);
  RoundTrip<trainer::OpdConfig>(*root);
  trainer::SftConfig sft;
  if (lm::DecodeConfig(*root, &sft).ok()) (void)trainer::ValidateSftConfig(sft);
  return 0;
}
