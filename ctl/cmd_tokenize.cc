// opd-ctl tokenize / detokenize: the tokenizer from the command line, one JSON line per input line.
//
//   opd-ctl tokenize --tokenizer DIR [--qwen3] [--input FILE] [--json]
//       text lines in (or {"text": "..."} lines with --json, so texts may hold newlines),
//       {"ids": [...]} lines out
//   opd-ctl detokenize --tokenizer DIR [--qwen3] [--input FILE] [--skip-special]
//       {"ids": [...]} lines in, {"text": "..."} lines out
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "ctl/args.h"
#include "ctl/command.h"
#include "lm/text/tokenizer.h"
#include "nlohmann/json.hpp"

namespace ctl {
namespace {

using json = nlohmann::json;

constexpr char kTokenizeUsage[] =
    "usage: opd-ctl tokenize --tokenizer DIR [--qwen3] [--input FILE] [--json]\n"
    "  Reads text lines (stdin by default; with --json, lines {\"text\": \"...\"}) and prints\n"
    "  one line {\"ids\": [...]} per input line.\n"
    "  --tokenizer DIR         tokenizer directory or tokenizer.json\n"
    "  --qwen3                 add Qwen3's added tokens\n"
    "  --input FILE            read this file instead of stdin\n"
    "  --json                  input lines are {\"text\": \"...\"}\n";
constexpr char kDetokenizeUsage[] =
    "usage: opd-ctl detokenize --tokenizer DIR [--qwen3] [--input FILE] [--skip-special]\n"
    "  Reads lines {\"ids\": [...]} (stdin by default) and prints one line {\"text\": \"...\"}\n"
    "  per input line.\n"
    "  --tokenizer DIR         tokenizer directory or tokenizer.json\n"
    "  --qwen3                 add Qwen3's added tokens\n"
    "  --input FILE            read this file instead of stdin\n"
    "  --skip-special          drop special tokens from the text\n";

// Parsed flags and the opened input shared by both commands.
struct Setup {
  Args args;
  std::unique_ptr<lm::Tokenizer> tokenizer;
  std::ifstream file;
  std::istream* in = &std::cin;
  std::string input_name = "<stdin>";
};

// Returns an exit code when the command should stop (bad flags: 2, load failure: 1).
int Prepare(const std::vector<std::string>& words, const std::set<std::string>& bool_flags,
            const char* usage, const char* command, Setup* s) {
  FlagSpec spec = {{"tokenizer", Kind::kString}, {"qwen3", Kind::kBool}, {"input", Kind::kString}};
  for (const auto& b : bool_flags) spec[b] = Kind::kBool;
  if (int rc = ParseCommandArgs(command, words, spec, {"tokenizer"}, usage, &s->args); rc >= 0)
    return rc;
  auto tok = lm::Tokenizer::Load(s->args.Get("tokenizer"),
                                 lm::TokenizerOptions::Qwen3(s->args.Flag("qwen3")));
  if (!tok.ok()) {
    std::fprintf(stderr, "opd-ctl %s: %s\n", command, tok.status().ToString().c_str());
    return 1;
  }
  s->tokenizer = std::move(*tok);
  if (s->args.Has("input")) {
    s->input_name = s->args.Get("input");
    s->file.open(s->input_name, std::ios::binary);
    if (!s->file) {
      std::fprintf(stderr, "opd-ctl %s: cannot open %s\n", command, s->input_name.c_str());
      return 1;
    }
    s->in = &s->file;
  }
  return -1;
}

void PrintLine(const json& j) {
  const std::string line = j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fflush(stdout);
}

int Fail(const char* command, const Setup& s, int64_t line_no, const std::string& why) {
  std::fprintf(stderr, "opd-ctl %s: %s:%lld: %s\n", command, s.input_name.c_str(),
               static_cast<long long>(line_no), why.c_str());
  return 1;
}

}  // namespace

int RunTokenize(const std::vector<std::string>& words) {
  Setup s;
  if (const int rc = Prepare(words, {"json"}, kTokenizeUsage, "tokenize", &s); rc >= 0) return rc;
  const bool json_lines = s.args.Flag("json");
  std::string line;
  for (int64_t line_no = 1; std::getline(*s.in, line); ++line_no) {
    std::string text = line;
    if (json_lines) {
      try {
        text = json::parse(line).at("text").get<std::string>();
      } catch (const json::exception& e) {
        return Fail("tokenize", s, line_no,
                    std::string("expected {\"text\": \"...\"}: ") + e.what());
      }
    }
    PrintLine(json{{"ids", s.tokenizer->Encode(text)}});
  }
  return 0;
}

int RunDetokenize(const std::vector<std::string>& words) {
  Setup s;
  if (const int rc = Prepare(words, {"skip-special"}, kDetokenizeUsage, "detokenize", &s); rc >= 0)
    return rc;
  const bool skip_special = s.args.Flag("skip-special");
  std::string line;
  for (int64_t line_no = 1; std::getline(*s.in, line); ++line_no) {
    std::vector<int32_t> ids;
    try {
      ids = json::parse(line).at("ids").get<std::vector<int32_t>>();
    } catch (const json::exception& e) {
      return Fail("detokenize", s, line_no, std::string("expected {\"ids\": [...]}: ") + e.what());
    }
    PrintLine(json{{"text", s.tokenizer->Decode(ids, skip_special)}});
  }
  return 0;
}

}  // namespace ctl
