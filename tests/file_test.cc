// lm/util/file.h: the one reader and writer of whole files. Errors name the file; a write leaves
// the old contents or the new, and no temporary beside them.
#include "lm/util/file.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "tests/testing.h"

namespace {

namespace fs = std::filesystem;

TEST(File, ReadsEveryByte) {
  const fs::path dir = testing_util::TempDir("file");
  const std::string bytes("a\0b\nc\xff", 6);  // NUL and a non-UTF-8 byte: binary, not text
  std::ofstream(dir / "f", std::ios::binary) << bytes;
  absl::StatusOr<std::string> read = lm::ReadFile((dir / "f").string());
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, bytes);
  fs::remove_all(dir);
}

TEST(File, AMissingFileIsNotFoundNamingIt) {
  const fs::path dir = testing_util::TempDir("file");
  const std::string path = (dir / "absent.yaml").string();
  absl::StatusOr<std::string> read = lm::ReadFile(path);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(read.status().message().find(path + ": cannot open"), std::string::npos)
      << read.status();
  fs::remove_all(dir);
}

TEST(File, AnAtomicWriteReplacesTheFileAndLeavesNoTemporary) {
  const fs::path dir = testing_util::TempDir("file");
  const std::string path = (dir / "state.json").string();
  ASSERT_TRUE(lm::WriteFileAtomic(path, "old").ok());
  ASSERT_TRUE(lm::WriteFileAtomic(path, "new contents").ok());
  EXPECT_EQ(*lm::ReadFile(path), "new contents");
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  fs::remove_all(dir);
}

TEST(File, AWriteIntoAMissingDirectoryFailsNamingTheFile) {
  const fs::path dir = testing_util::TempDir("file");
  const std::string path = (dir / "no_such_dir" / "f").string();
  const absl::Status st = lm::WriteFileAtomic(path, "x");
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find(path), std::string::npos) << st;
  fs::remove_all(dir);
}

}  // namespace
