// Tokenizer throughput on one thread. Reads a JSON-lines corpus ({"text": ...} per line), encodes
// every document --iters times and prints MB/s of input text. scripts/bench_tokenizer.sh runs it
// next to the Rust `tokenizers` library on the same file.
//
//   bench_tokenizer --tokenizer DIR --corpus FILE [--iters N] [--qwen3]
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "lm/text/tokenizer.h"
#include "nlohmann/json.hpp"

namespace {

struct Flags {
  std::string tokenizer, corpus;
  int iters = 3;
  bool qwen3 = false;
};

bool ParseFlags(int argc, char** argv, Flags* f) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--tokenizer" && has_value) {
      f->tokenizer = argv[++i];
    } else if (a == "--corpus" && has_value) {
      f->corpus = argv[++i];
    } else if (a == "--iters" && has_value) {
      f->iters = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--qwen3") {
      f->qwen3 = true;
    } else {
      return false;
    }
  }
  return !f->tokenizer.empty() && !f->corpus.empty();
}

bool ReadCorpus(const std::string& path, std::vector<std::string>* docs) {
  std::ifstream in(path);
  if (!in) return false;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    try {
      docs->push_back(nlohmann::json::parse(line).at("text").get<std::string>());
    } catch (const nlohmann::json::exception& e) {
      std::fprintf(stderr, "%s: bad line: %s\n", path.c_str(), e.what());
      return false;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Flags flags;
  if (!ParseFlags(argc, argv, &flags)) {
    std::fprintf(stderr,
                 "usage: bench_tokenizer --tokenizer DIR --corpus FILE.jsonl [--iters N] "
                 "[--qwen3]\n");
    return 2;
  }
  auto tok = lm::Tokenizer::Load(flags.tokenizer, lm::TokenizerOptions::Qwen3(flags.qwen3));
  if (!tok.ok()) {
    std::fprintf(stderr, "bench_tokenizer: %s\n", tok.status().ToString().c_str());
    return 1;
  }
  std::vector<std::string> docs;
  if (!ReadCorpus(flags.corpus, &docs)) {
    std::fprintf(stderr, "bench_tokenizer: cannot read %s\n", flags.corpus.c_str());
    return 1;
  }
  size_t bytes = 0;
  for (const auto& d : docs) bytes += d.size();

  // One untimed pass warms the word cache, as the reference's first pass warms its own.
  size_t tokens = 0;
  for (const auto& d : docs) tokens += (*tok)->Encode(d).size();

  const auto start = std::chrono::steady_clock::now();
  size_t checksum = 0;
  for (int it = 0; it < flags.iters; ++it)
    for (const auto& d : docs) checksum += (*tok)->Encode(d).size();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double mb = static_cast<double>(bytes) * flags.iters / 1e6;
  std::printf("docs=%zu bytes=%zu tokens=%zu iters=%d seconds=%.3f\n", docs.size(), bytes, tokens,
              flags.iters, seconds);
  std::printf("opd MB/s=%.2f\n", mb / seconds);
  return checksum == tokens * flags.iters ? 0 : 1;
}
