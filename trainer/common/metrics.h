// Per-step metrics, written two ways:
//   TensorBoard event files, hand-encoded: TFRecord framing (length, masked CRC32C of the length,
//     payload, masked CRC32C of the payload) around Event protos whose Summary values carry a
//     `simple_value` scalar, exactly what tensorboard's event_accumulator reads;
//   JSON lines in the run directory (one object per logged step, flushed each time).
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace trainer {

// CRC32C (Castagnoli), as TFRecord and leveldb use it; and TFRecord's masked form
// ((crc >> 15 | crc << 17) + 0xa282ead8).
uint32_t Crc32c(const void* data, size_t n);
uint32_t MaskedCrc32c(const void* data, size_t n);

// Ordered (tag, value) pairs: one step's metrics.
using Scalars = std::vector<std::pair<std::string, double>>;

class TensorBoardWriter {
 public:
  // Creates <dir>/events.out.tfevents.<seconds>.<host>.<pid> and writes its file_version record.
  static absl::StatusOr<std::unique_ptr<TensorBoardWriter>> Create(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // A SessionLog START event at `step`. TensorBoard then discards events of the earlier
  // (interrupted) session with a larger step, so a resumed run's curve has no duplicates.
  void SessionStart(int64_t step);
  // One Event holding every scalar of the step; flushed.
  void Write(int64_t step, const Scalars& scalars);
  const std::string& path() const { return path_; }

 private:
  TensorBoardWriter(std::FILE* file, std::string path) : file_(file), path_(std::move(path)) {}
  void WriteRecord(const std::string& payload);
  std::FILE* file_;
  std::string path_;
};

class JsonlWriter {
 public:
  // Appends to `path`. When `keep_through_step` >= 0, lines with a larger "step" are removed
  // first: a resumed run rewrites the steps after its checkpoint.
  static absl::StatusOr<std::unique_ptr<JsonlWriter>> Open(const std::string& path,
                                                           int64_t keep_through_step);
  ~JsonlWriter();
  JsonlWriter(const JsonlWriter&) = delete;
  JsonlWriter& operator=(const JsonlWriter&) = delete;

  // {"step": step, "time": unix seconds, tag: value, ...}; non-finite values become null.
  void Write(int64_t step, const Scalars& scalars);

 private:
  explicit JsonlWriter(std::FILE* file) : file_(file) {}
  std::FILE* file_;
};

// Both sinks behind one call.
class MetricsLogger {
 public:
  // `resume_step` >= 0: continuing a run from that step (see JsonlWriter and SessionStart).
  static absl::StatusOr<MetricsLogger> Open(const std::string& jsonl_path,
                                            const std::string& tensorboard_dir, bool tensorboard,
                                            int64_t resume_step);
  void Log(int64_t step, const Scalars& scalars);

 private:
  std::unique_ptr<JsonlWriter> jsonl_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
};

}  // namespace trainer
