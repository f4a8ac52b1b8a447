// Test helpers for external teachers: the fake SGLang / vLLM server
// (tests/python/fake_inference_server.py) and an opd-teacher, each a child process on an ephemeral
// loopback port, stopped when the object goes away.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "child_process.h"
#include "rpc/client.h"
#include "tests/testing.h"

namespace testing_util {

// A fresh directory under the test's temp dir.
inline std::filesystem::path FreshDir(const std::string& tag) {
  static int n = 0;
  const auto d = std::filesystem::path(::testing::TempDir()) /
                 (tag + "_" + std::to_string(getpid()) + "_" + std::to_string(n++));
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

// The fake server in `mode` with extra `flags` (--model DIR, --tls-cert ..., --marker FILE).
class FakeInferenceServer {
 public:
  explicit FakeInferenceServer(const std::string& mode, const std::vector<std::string>& flags = {})
      : dir_(FreshDir("fake_server")) {
    std::vector<std::string> argv = {OPD_PYTHON,
                                     OPD_SOURCE_DIR "/tests/python/fake_inference_server.py", mode};
    argv.insert(argv.end(), flags.begin(), flags.end());
    served_ = StartServed(dir_, "fake", std::move(argv), std::chrono::seconds(120));
  }
  std::string Endpoint(const std::string& scheme) const { return scheme + "://" + served_.address; }
  bool ok() const { return !served_.address.empty(); }
  const std::filesystem::path& dir() const { return dir_; }
  std::string Log() const { return served_.process->Log(); }

 private:
  std::filesystem::path dir_;
  Served served_;
};

// An opd-teacher serving `model` (and `tokenizer` when given), with a 0600 secret file.
class OpdTeacherProcess {
 public:
  static constexpr const char* kSecret = "http-teacher-test-secret";
  explicit OpdTeacherProcess(const std::string& model, const std::string& tokenizer = "",
                             std::string secret_text = kSecret)
      : dir_(FreshDir("opd_teacher")), secret_(std::move(secret_text)) {
    const auto secret = dir_ / "secret";
    std::ofstream(secret) << secret_ << "\n";
    std::filesystem::permissions(
        secret, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
    std::vector<std::string> argv = {std::string(OPD_BINARY_DIR) + "/teacher_service/opd-teacher",
                                     "--model=" + model, "--secret-file=" + secret.string(),
                                     "--threads=1"};
    if (!tokenizer.empty()) argv.push_back("--tokenizer=" + tokenizer);
    served_ = StartServed(dir_, "opd_teacher", std::move(argv), std::chrono::seconds(120));
    opd::rpc::ClientOptions o = Options();
    const absl::Status serving = opd::rpc::WaitUntilServing(o, absl::Seconds(60));
    EXPECT_TRUE(serving.ok()) << serving << "\n" << served_.process->Log();
  }
  opd::rpc::ClientOptions Options() const {
    opd::rpc::ClientOptions o;
    o.address = served_.address;
    o.secret = secret_;
    o.timeout = absl::Seconds(60);
    return o;
  }
  const std::string& address() const { return served_.address; }
  bool ok() const { return !served_.address.empty(); }

 private:
  std::filesystem::path dir_;
  std::string secret_;
  Served served_;
};

}  // namespace testing_util
