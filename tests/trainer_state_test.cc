// A checkpoint's trainer_state.json is read field by field before a resume uses it: a negative
// step (which named directories step_-00006), impossible counts and a garbage RNG state are
// DATA_LOSS naming the file and the field, in one line.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "nlohmann/json.hpp"
#include "tests/testing.h"
#include "trainer/common/checkpoint.h"

namespace {

namespace fs = std::filesystem;

nlohmann::json GoodState() {
  return {{"version", trainer::kTrainerStateVersion},
          {"step", 6},
          {"optimizer_steps", 5},
          {"nonfinite", {{"consecutive", 0}, {"total", 1}}},
          {"rng", trainer::CaptureRngState()},
          {"data_cursor", {{"step", 12}, {"consumed", {12}}}}};
}

absl::Status Check(const nlohmann::json& j) {
  return trainer::CheckTrainerState(j, "X/state");
}

TEST(TrainerState, AGoodStatePasses) {
  EXPECT_TRUE(Check(GoodState()).ok());
}

TEST(TrainerState, EveryCountIsRangeChecked) {
  struct Case {
    std::function<void(nlohmann::json*)> edit;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {[](auto* j) { (*j)["step"] = -6; }, "step = -6 is outside"},
      {[](auto* j) { (*j)["step"] = "6"; }, "step is missing or not an integer"},
      {[](auto* j) { j->erase("step"); }, "step is missing"},
      {[](auto* j) { (*j)["optimizer_steps"] = 7; }, "optimizer_steps = 7 is outside [0, 6]"},
      {[](auto* j) { (*j)["optimizer_steps"] = -1; }, "optimizer_steps = -1"},
      {[](auto* j) { (*j)["nonfinite"]["total"] = 9; }, "nonfinite.total = 9"},
      {[](auto* j) { (*j)["nonfinite"]["consecutive"] = 2; }, "nonfinite.consecutive = 2"},
      {[](auto* j) { j->erase("nonfinite"); }, "nonfinite is missing"},
      {[](auto* j) { (*j)["rng"]["cpu"] = 3; }, "rng.cpu"},
      {[](auto* j) { j->erase("data_cursor"); }, "data_cursor"},
  };
  for (const auto& c : cases) {
    nlohmann::json j = GoodState();
    c.edit(&j);
    const absl::Status s = Check(j);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << c.expected << ": " << s;
    EXPECT_NE(s.message().find("X/state"), std::string::npos) << s;
    EXPECT_NE(s.message().find(c.expected), std::string::npos) << s;
  }
}

TEST(TrainerState, ReadTrainerStateChecksTheFields) {
  const fs::path dir = testing_util::TestDir() / "trainer_state_read";
  fs::create_directories(dir);
  nlohmann::json j = GoodState();
  j["step"] = -6;
  std::ofstream(dir / "trainer_state.json") << j.dump();
  const auto read = trainer::ReadTrainerState(dir.string());
  EXPECT_EQ(read.status().code(), absl::StatusCode::kDataLoss) << read.status();
  EXPECT_NE(read.status().message().find("step = -6"), std::string::npos) << read.status();
  fs::remove_all(dir);
}

// A state of the wrong size for the generator: one line naming the field, no C++ backtrace.
TEST(TrainerState, AGarbageRngStateIsOneLineNamingTheField) {
  nlohmann::json rng = trainer::CaptureRngState();
  rng["cpu"] = "Z2FyYmFnZQ==";  // base64 of "garbage"
  const absl::Status s = trainer::RestoreRngState(rng);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("rng.cpu"), std::string::npos) << s;
  EXPECT_EQ(s.message().find('\n'), std::string::npos) << s;
  EXPECT_EQ(s.message().find("Exception raised from"), std::string::npos) << s;
  // The generator is untouched by the refusal: a good state still restores.
  EXPECT_TRUE(trainer::RestoreRngState(trainer::CaptureRngState()).ok());
}

}  // namespace
