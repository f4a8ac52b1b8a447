// model.safetensors.index.json parsing: any text either is refused with an error naming the file,
// or yields a weight map whose every shard name stays inside the model directory.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "fuzz/fuzz_util.h"
#include "lm/io/safetensors.h"

namespace {

bool Confined(const std::string& shard) {
  if (shard.empty() || shard[0] == '/' || shard.find('\0') != std::string::npos) return false;
  size_t start = 0;
  for (;;) {
    const size_t slash = shard.find('/', start);
    const std::string_view part =
        std::string_view(shard).substr(start, slash == std::string::npos ? slash : slash - start);
    if (part == "..") return false;
    if (slash == std::string::npos) return true;
    start = slash + 1;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto index = lm::ParseSafetensorsIndex(text, "fuzz/model.safetensors.index.json");
  if (!index.ok()) {
    fuzz::CheckNamed(index.status(), "fuzz/model.safetensors.index.json: ");
    return 0;
  }
  FUZZ_CHECK(std::is_sorted(index->shards.begin(), index->shards.end()), "shards unsorted");
  FUZZ_CHECK(std::adjacent_find(index->shards.begin(), index->shards.end()) == index->shards.end(),
             "shards repeated");
  for (const std::string& shard : index->shards) FUZZ_CHECK(Confined(shard), shard);
  for (const auto& [tensor, shard] : index->weight_map)
    FUZZ_CHECK(std::binary_search(index->shards.begin(), index->shards.end(), shard), tensor);
  return 0;
}
