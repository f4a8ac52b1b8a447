#include "trainer/common/metrics.h"

#include <unistd.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace trainer {
namespace {

namespace fs = std::filesystem;

// Table for the reflected Castagnoli polynomial 0x82F63B78.
std::array<uint32_t, 256> MakeCrcTable() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}

double UnixSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// --- protobuf wire format, just the pieces an Event needs ---
void PutVarint(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

template <class T>
void PutFixed(std::string* out, T v) {  // little-endian, as the wire format wants (x86 is LE)
  char buf[sizeof(T)];
  std::memcpy(buf, &v, sizeof(T));
  out->append(buf, sizeof(T));
}

// Field tag: (number << 3) | wire type (0 varint, 1 fixed64, 2 length-delimited, 5 fixed32).
void PutTag(std::string* out, int field, int wire_type) {
  PutVarint(out, (field << 3) | wire_type);
}

void PutBytes(std::string* out, int field, const std::string& bytes) {
  PutTag(out, field, 2);
  PutVarint(out, bytes.size());
  out->append(bytes);
}

// Event { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5;
//         SessionLog session_log = 6; }
std::string EventHeader(int64_t step) {
  std::string e;
  PutTag(&e, 1, 1);
  PutFixed<double>(&e, UnixSeconds());
  PutTag(&e, 2, 0);
  PutVarint(&e, static_cast<uint64_t>(step));
  return e;
}

// Summary { repeated Value value = 1; }  Value { string tag = 1; float simple_value = 2; }
std::string EncodeSummary(const Scalars& scalars) {
  std::string summary;
  for (const auto& [tag, value] : scalars) {
    std::string v;
    PutBytes(&v, 1, tag);
    PutTag(&v, 2, 5);
    PutFixed<float>(&v, static_cast<float>(value));
    PutBytes(&summary, 1, v);
  }
  return summary;
}

std::string HostName() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "localhost";
  return buf;
}

}  // namespace

uint32_t Crc32c(const void* data, size_t n) {
  static const std::array<uint32_t, 256> table = MakeCrcTable();
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t MaskedCrc32c(const void* data, size_t n) {
  const uint32_t crc = Crc32c(data, n);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

absl::StatusOr<std::unique_ptr<TensorBoardWriter>> TensorBoardWriter::Create(
    const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  // The name pattern is what TensorBoard globs for; the pid keeps restarts apart.
  const std::string path =
      absl::StrCat(dir, "/events.out.tfevents.", static_cast<int64_t>(UnixSeconds()), ".",
                   HostName(), ".", ::getpid());
  std::FILE* f = std::fopen(path.c_str(), "ab");
  if (f == nullptr) return absl::PermissionDeniedError(absl::StrCat(path, ": cannot create"));
  std::unique_ptr<TensorBoardWriter> w(new TensorBoardWriter(f, path));
  std::string event = EventHeader(0);
  PutBytes(&event, 3, "brain.Event:2");
  w->WriteRecord(event);
  return w;
}

TensorBoardWriter::~TensorBoardWriter() {
  std::fclose(file_);
}

void TensorBoardWriter::WriteRecord(const std::string& payload) {
  std::string rec;
  const uint64_t len = payload.size();
  PutFixed<uint64_t>(&rec, len);
  PutFixed<uint32_t>(&rec, MaskedCrc32c(rec.data(), 8));
  rec.append(payload);
  PutFixed<uint32_t>(&rec, MaskedCrc32c(payload.data(), payload.size()));
  std::fwrite(rec.data(), 1, rec.size(), file_);
  std::fflush(file_);
}

void TensorBoardWriter::SessionStart(int64_t step) {
  std::string session_log;  // SessionLog { SessionStatus status = 1; }  START = 1
  PutTag(&session_log, 1, 0);
  PutVarint(&session_log, 1);
  std::string event = EventHeader(step);
  PutBytes(&event, 6, session_log);
  WriteRecord(event);
}

void TensorBoardWriter::Write(int64_t step, const Scalars& scalars) {
  std::string event = EventHeader(step);
  PutBytes(&event, 5, EncodeSummary(scalars));
  WriteRecord(event);
}

absl::StatusOr<std::unique_ptr<JsonlWriter>> JsonlWriter::Open(const std::string& path,
                                                               int64_t keep_through_step) {
  if (keep_through_step >= 0 && fs::exists(path)) {
    // Keep the lines up to the checkpoint; a line cut by a crash (no newline) is dropped too.
    std::ifstream in(path);
    std::string line, kept;
    while (std::getline(in, line)) {
      if (in.eof()) break;  // last line had no newline: incomplete
      auto j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_discarded() || !j.contains("step")) continue;
      if (j["step"].get<int64_t>() <= keep_through_step) kept += line + "\n";
    }
    in.close();
    std::ofstream out(path, std::ios::trunc);
    out << kept;
  } else if (keep_through_step < 0) {
    std::ofstream out(path, std::ios::trunc);  // a fresh run starts a fresh file
  }
  std::FILE* f = std::fopen(path.c_str(), "a");
  if (f == nullptr) return absl::PermissionDeniedError(absl::StrCat(path, ": cannot open"));
  return std::unique_ptr<JsonlWriter>(new JsonlWriter(f));
}

JsonlWriter::~JsonlWriter() {
  std::fclose(file_);
}

void JsonlWriter::Write(int64_t step, const Scalars& scalars) {
  nlohmann::ordered_json j;
  j["step"] = step;
  j["time"] = UnixSeconds();
  for (const auto& [tag, value] : scalars) {
    if (std::isfinite(value)) {
      j[tag] = value;
    } else {
      j[tag] = nullptr;
    }
  }
  const std::string line = j.dump() + "\n";
  std::fwrite(line.data(), 1, line.size(), file_);
  std::fflush(file_);
}

absl::StatusOr<MetricsLogger> MetricsLogger::Open(const std::string& jsonl_path,
                                                  const std::string& tensorboard_dir,
                                                  bool tensorboard, int64_t resume_step) {
  MetricsLogger m;
  absl::StatusOr<std::unique_ptr<JsonlWriter>> jsonl = JsonlWriter::Open(jsonl_path, resume_step);
  if (!jsonl.ok()) return jsonl.status();
  m.jsonl_ = std::move(*jsonl);
  if (tensorboard) {
    absl::StatusOr<std::unique_ptr<TensorBoardWriter>> tb =
        TensorBoardWriter::Create(tensorboard_dir);
    if (!tb.ok()) return tb.status();
    m.tensorboard_ = std::move(*tb);
    if (resume_step >= 0) m.tensorboard_->SessionStart(resume_step + 1);
  }
  return m;
}

void MetricsLogger::Log(int64_t step, const Scalars& scalars) {
  jsonl_->Write(step, scalars);
  if (tensorboard_) tensorboard_->Write(step, scalars);
}

}  // namespace trainer
