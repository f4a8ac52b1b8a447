// The one byte codec for what processes of a group send each other (the learner ranks' held-out
// values, the expert-parallel teacher's batches, the expert-parallel rollout's weight commands) and
// for the samples a checkpoint keeps: fixed-width scalars and length-prefixed arrays, in the host's
// byte order (little-endian on every machine this runs on), read back with bounds checks.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace lm {

class ByteWriter {
 public:
  template <class T>
  void Put(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    out_.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  // A u64 element count, then the elements.
  template <class T>
  void PutArray(const T* data, size_t n) {
    static_assert(std::is_trivially_copyable_v<T>);
    Put<uint64_t>(n);
    out_.append(reinterpret_cast<const char*>(data), n * sizeof(T));
  }
  template <class T>
  void PutVector(const std::vector<T>& v) {
    PutArray(v.data(), v.size());
  }
  void PutString(std::string_view s) { PutArray(s.data(), s.size()); }

  std::string& bytes() { return out_; }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

// Each Get returns false (and leaves the reader failed) when the bytes run out or a count does
// not fit in what is left, so that a truncated or malformed message is an error, never a crash.
class ByteReader {
 public:
  explicit ByteReader(std::string_view bytes) : rest_(bytes) {}

  template <class T>
  bool Get(T* v) {
    static_assert(std::is_trivially_copyable_v<T>);
    if (!Need(sizeof(T))) return false;
    std::memcpy(v, rest_.data(), sizeof(T));
    rest_.remove_prefix(sizeof(T));
    return true;
  }
  template <class T>
  bool GetVector(std::vector<T>* v) {
    uint64_t n = 0;
    if (!Get(&n) || n > rest_.size() / sizeof(T)) return Fail();
    v->resize(n);
    if (n > 0) std::memcpy(v->data(), rest_.data(), n * sizeof(T));
    rest_.remove_prefix(n * sizeof(T));
    return true;
  }
  // A view into the reader's bytes.
  bool GetString(std::string_view* s) {
    uint64_t n = 0;
    if (!Get(&n) || n > rest_.size()) return Fail();
    *s = rest_.substr(0, n);
    rest_.remove_prefix(n);
    return true;
  }

  bool ok() const { return ok_; }
  bool done() const { return ok_ && rest_.empty(); }

 private:
  bool Need(size_t n) { return n <= rest_.size() || Fail(); }
  bool Fail() {
    ok_ = false;
    rest_ = {};
    return false;
  }
  std::string_view rest_;
  bool ok_ = true;
};

}  // namespace lm
