// SHA-256 (FIPS 180-4) for the tokenizer's fingerprint: small and dependency-free, so that the
// text library needs no crypto library for one hash of a few megabytes at load time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace lm {

class Sha256 {
 public:
  Sha256() { Reset(); }
  void Update(const void* data, size_t n);
  void Update(std::string_view s) { Update(s.data(), s.size()); }
  // Big-endian, four bytes.
  void UpdateU32(uint32_t v);
  // Length-prefixed, so that concatenations cannot collide.
  void UpdateField(std::string_view s) {
    UpdateU32(static_cast<uint32_t>(s.size()));
    Update(s);
  }
  // Pads the message and returns the digest as 64 lowercase hex digits. Ends the hash: call
  // nothing else on this object afterwards.
  std::string HexDigest();

 private:
  void Reset();
  void Compress(const uint8_t* block);

  uint32_t h_[8];
  uint8_t block_[64];
  size_t fill_;
  uint64_t total_;
};

}  // namespace lm
