// The tiny random models the fixture scripts write, named here so that the test binaries list
// their tests before the fixtures exist (ctest's entries come from that listing at build time);
// parity_test's Fixtures.IndexListsThem keeps these equal to each script's index.json.
#pragma once

#include <string>
#include <vector>

namespace testing_util {

// tests/python/make_fixtures.py (Qwen3-MoE, and Qwen3 dense), in OPD_FIXTURES_DIR.
inline std::vector<std::string> MoeFixtureNames() {
  return {"moe_tied_topk8", "moe_untied_top1_sparse2", "moe_mlp_only_gqa4", "dense_qwen3",
          "moe_many_experts"};
}

// tests/python/make_next_fixtures.py (Qwen3-Next), in OPD_NEXT_FIXTURES_DIR.
inline std::vector<std::string> NextFixtureNames() {
  return {"next_interval4", "next_interval2_tied", "next_full_first_ratio4", "next_sparse2_ratio3"};
}

}  // namespace testing_util
