// Tests of the safetensors reader and writer: round trips, interop with Python `safetensors`,
// named errors for every kind of malformed file, and a header fuzz loop.
#include "lm/io/safetensors.h"

#include <stdlib.h>
#include <sys/wait.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace lm {
namespace {

namespace fs = std::filesystem;

// Substring check with a readable failure (plain gtest: the target does not link gmock).
::testing::AssertionResult Contains(absl::string_view haystack, absl::string_view needle) {
  if (absl::StrContains(haystack, needle)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "\"" << haystack << "\" does not contain \"" << needle << "\"";
}

// A fresh directory under $TMPDIR, removed with everything in it at scope exit.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "safetensors_test.XXXXXX").string();
    if (mkdtemp(tmpl.data()) == nullptr) ADD_FAILURE() << "mkdtemp failed: " << tmpl;
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string File(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

std::vector<std::byte> ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> chars((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> bytes(chars.size());
  std::memcpy(bytes.data(), chars.data(), chars.size());
  return bytes;
}

uint64_t HeaderLength(const std::vector<std::byte>& image) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint64_t>(image[i]);
  return n;
}

void SetHeaderLength(std::vector<std::byte>& image, uint64_t n) {
  for (int i = 0; i < 8; ++i) image[i] = static_cast<std::byte>((n >> (8 * i)) & 0xff);
}

// A file image: length prefix, `header` verbatim, then `data_size` bytes of data.
std::vector<std::byte> Image(const std::string& header, size_t data_size) {
  std::vector<std::byte> image(8 + header.size() + data_size, std::byte{0x5a});
  SetHeaderLength(image, header.size());
  std::memcpy(image.data() + 8, header.data(), header.size());
  return image;
}

absl::StatusOr<std::shared_ptr<const SafetensorsFile>> Parse(const std::vector<std::byte>& image,
                                                             const std::string& label) {
  return SafetensorsFile::FromBuffer(nullptr, image.data(), image.size(), label);
}

template <typename T>
std::vector<T> Values(const TensorView& v) {
  std::vector<T> out(v.nbytes / sizeof(T));
  std::memcpy(out.data(), v.data, v.nbytes);  // the mapping need not be aligned for T
  return out;
}

template <typename T>
TensorToWrite ToWrite(const std::string& name, DType dtype, std::vector<int64_t> shape,
                      const std::vector<T>& values) {
  return {name, dtype, std::move(shape), values.data(), values.size() * sizeof(T)};
}

// Runs `script` with the venv Python and `args`; returns the exit status (-1 if it did not exit).
int RunPython(const TempDir& dir, const std::string& script, const std::string& args) {
  const std::string script_path = dir.File("script.py");
  std::ofstream(script_path) << script;
  const std::string cmd = absl::StrCat("'", OPD_PYTHON, "' '", script_path, "' ", args);
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

// Bit patterns shared by the C++ and Python sides: exactly representable values only.
const std::vector<float> kF32 = {0.0f, 1.5f, -2.25f, 3.0f, 0.125f, -7.0f};
const std::vector<uint16_t> kF16 = {0x3C00, 0xC000, 0x3800, 0x7BFF, 0x0001};  // 1 -2 .5 65504 2^-24
const std::vector<uint16_t> kBF16 = {0x3F80, 0xC000, 0x4040, 0x3E20};         // 1 -2 3 0.15625
const std::vector<float> kScalar = {42.0f};
const std::vector<float> kEmpty;

std::vector<TensorToWrite> SampleTensors() {
  return {ToWrite("a_f32", DType::kF32, {2, 3}, kF32), ToWrite("b_f16", DType::kF16, {5}, kF16),
          ToWrite("c_bf16", DType::kBF16, {2, 2}, kBF16),
          ToWrite("scalar", DType::kF32, {}, kScalar),
          ToWrite("empty", DType::kF32, {0, 3}, kEmpty)};
}

// --- dtypes -----------------------------------------------------------------------------------

TEST(DTypeTest, ParseNameAndSize) {
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16, DType::kF8E4M3}) {
    auto parsed = ParseDType(DTypeName(d));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, d);
  }
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
  EXPECT_EQ(DTypeSize(DType::kF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kF8E4M3), 1u);
  EXPECT_STREQ(DTypeName(DType::kF8E4M3), "F8_E4M3");
  EXPECT_TRUE(Contains(ParseDType("I64").status().message(), "unsupported dtype 'I64'"));
  // The other FP8 formats stay refused, naming what is read.
  EXPECT_TRUE(Contains(ParseDType("F8_E5M2").status().message(),
                       "unsupported dtype 'F8_E5M2' (supported: F32, F16, BF16, F8_E4M3)"));
  EXPECT_TRUE(Contains(ParseDType("f32").status().message(), "unknown dtype 'f32'"));
}

// --- round trips ------------------------------------------------------------------------------

TEST(SafetensorsRoundTrip, AllDtypesScalarAndEmpty) {
  TempDir dir;
  const std::string path = dir.File("rt.safetensors");
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"k", "v"}};
  ASSERT_TRUE(WriteSafetensors(path, SampleTensors(), metadata).ok());

  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->path(), path);
  EXPECT_EQ((*file)->metadata(), metadata);
  ASSERT_EQ((*file)->tensors().size(), 5u);

  auto a = (*file)->Get("a_f32");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->dtype, DType::kF32);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a->numel(), 6);
  EXPECT_EQ(Values<float>(*a), kF32);

  auto b = (*file)->Get("b_f16");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->dtype, DType::kF16);
  EXPECT_EQ(Values<uint16_t>(*b), kF16);

  auto c = (*file)->Get("c_bf16");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->dtype, DType::kBF16);
  EXPECT_EQ(c->shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(Values<uint16_t>(*c), kBF16);

  auto s = (*file)->Get("scalar");
  ASSERT_TRUE(s.ok());
  EXPECT_TRUE(s->shape.empty());
  EXPECT_EQ(s->numel(), 1);
  EXPECT_EQ(Values<float>(*s), kScalar);

  auto e = (*file)->Get("empty");
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->shape, (std::vector<int64_t>{0, 3}));
  EXPECT_EQ(e->numel(), 0);
  EXPECT_EQ(e->nbytes, 0u);
}

TEST(SafetensorsRoundTrip, HeaderPaddedSortedAndNoTmpLeft) {
  TempDir dir;
  const std::string path = dir.File("pad.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, SampleTensors(), {{"format", "pt"}}).ok());
  EXPECT_FALSE(fs::exists(path + ".tmp"));

  const std::vector<std::byte> image = ReadBytes(path);
  const uint64_t n = HeaderLength(image);
  EXPECT_EQ(n % 8, 0u);
  const std::string header(reinterpret_cast<const char*>(image.data()) + 8, n);
  // Tensors are packed in name order right after the header: a_f32, b_f16, c_bf16, empty, scalar.
  EXPECT_TRUE(Contains(header, R"("a_f32":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]})"));
  EXPECT_TRUE(Contains(header, R"("scalar":{"dtype":"F32","shape":[],"data_offsets":[42,46]})"));
  EXPECT_EQ(image.size(), 8 + n + 24 + 10 + 8 + 0 + 4);
  const size_t json_end = header.find_last_of('}');
  EXPECT_EQ(header.find_first_not_of(' ', json_end + 1), std::string::npos);
}

TEST(SafetensorsRoundTrip, NoTensors) {
  TempDir dir;
  const std::string path = dir.File("empty.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {}).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE((*file)->tensors().empty());
  EXPECT_TRUE((*file)->metadata().empty());
}

TEST(SafetensorsRoundTrip, GetUnknownTensorIsNotFound) {
  TempDir dir;
  const std::string path = dir.File("get.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, SampleTensors()).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok());
  auto missing = (*file)->Get("model.nope");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Contains(missing.status().message(), path));
  EXPECT_TRUE(Contains(missing.status().message(), "'model.nope'"));
}

// --- writer errors ----------------------------------------------------------------------------

TEST(SafetensorsWrite, RejectsBadTensors) {
  TempDir dir;
  const std::string path = dir.File("bad.safetensors");
  const std::vector<float> four(4, 1.0f);
  struct Case {
    std::vector<TensorToWrite> tensors;
    std::string tensor, fragment;
  };
  const std::vector<Case> cases = {
      {{ToWrite("short", DType::kF32, {5}, four)}, "short", "needs 20 bytes, but 16 were given"},
      {{ToWrite("dup", DType::kF32, {4}, four), ToWrite("dup", DType::kF32, {4}, four)},
       "dup",
       "duplicate name"},
      {{ToWrite("__metadata__", DType::kF32, {4}, four)}, "__metadata__", "reserved"},
      {{ToWrite("neg", DType::kF32, {-1, -4}, four)}, "neg", "negative dimension"},
      {{TensorToWrite{"null", DType::kF16, {2}, nullptr, 4}}, "null", "null pointer"},
      {{ToWrite("bad\xff", DType::kF32, {4}, four)}, "bad\xff", "not valid UTF-8"},
  };
  for (const Case& c : cases) {
    absl::Status s = WriteSafetensors(path, c.tensors);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(Contains(s.message(), path));
    EXPECT_TRUE(Contains(s.message(), "'" + c.tensor + "'"));
    EXPECT_TRUE(Contains(s.message(), c.fragment));
    EXPECT_FALSE(fs::exists(path));
    EXPECT_FALSE(fs::exists(path + ".tmp"));
  }
}

TEST(SafetensorsWrite, IoErrorNamesPathAndErrno) {
  TempDir dir;
  const std::string path = dir.File("no_such_dir/out.safetensors");
  absl::Status s = WriteSafetensors(path, SampleTensors());
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_TRUE(Contains(s.message(), path));
  EXPECT_TRUE(Contains(s.message(), "No such file or directory"));
}

// --- Open errors ------------------------------------------------------------------------------

TEST(SafetensorsOpen, MissingDirectoryEmptyAndTruncatedFiles) {
  TempDir dir;
  auto missing = SafetensorsFile::Open(dir.File("absent.safetensors"));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Contains(missing.status().message(), "absent.safetensors"));
  EXPECT_TRUE(Contains(missing.status().message(), "No such file or directory"));

  auto directory = SafetensorsFile::Open(dir.File(""));
  EXPECT_EQ(directory.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(directory.status().message(), "not a regular file"));

  const std::string empty = dir.File("empty.safetensors");
  std::ofstream(empty).close();
  auto empty_file = SafetensorsFile::Open(empty);
  EXPECT_EQ(empty_file.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(empty_file.status().message(), empty));

  // A real file cut short in its last tensor (name order: scalar is last).
  const std::string cut = dir.File("cut.safetensors");
  ASSERT_TRUE(WriteSafetensors(cut, SampleTensors()).ok());
  fs::resize_file(cut, fs::file_size(cut) - 2);
  auto truncated = SafetensorsFile::Open(cut);
  EXPECT_EQ(truncated.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(truncated.status().message(), cut + ": tensor 'scalar'"));
  EXPECT_TRUE(Contains(truncated.status().message(), "file truncated or corrupted"));
}

// --- malformed images -------------------------------------------------------------------------

struct BadCase {
  std::string name;  // test name suffix
  std::vector<std::byte> image;
  absl::StatusCode code;
  std::vector<std::string> fragments;  // each must appear in the message
};

std::string Entry(const std::string& name, const std::string& body) {
  return absl::StrCat("\"", name, "\":", body);
}

BadCase Bad(std::string name, std::string header, size_t data_size, absl::StatusCode code,
            std::vector<std::string> fragments) {
  return {std::move(name), Image(header, data_size), code, std::move(fragments)};
}

std::vector<BadCase> BadCases() {
  using C = absl::StatusCode;
  const C kInv = C::kInvalidArgument;
  const std::string ok_w = Entry("w", R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})");
  std::vector<BadCase> cases = {
      {"TooShortForLength", std::vector<std::byte>(5), C::kDataLoss, {"5 bytes", "truncated"}},
      Bad("DataCut", "{" + Entry("w", R"({"dtype":"F32","shape":[3],"data_offsets":[0,12]})") + "}",
          8, C::kDataLoss,
          {"tensor 'w'", "data_offsets [0, 12] exceed the data block (8 bytes)", "truncated"}),
      Bad("NotJson", "{\"w\": nope}", 8, kInv, {"not valid JSON"}),
      Bad("EmptyHeader", "", 8, kInv, {"not valid JSON"}),
      Bad("NotAnObject", "[1, 2, 3]", 8, kInv, {"header is a JSON array, expected an object"}),
      Bad("EntryNotObject", "{\"w\": [1]}", 8, kInv, {"tensor 'w'", "expected an object"}),
      Bad("OffsetsOutOfRange",
          "{" + Entry("w", R"({"dtype":"F32","shape":[24],"data_offsets":[0,96]})") + "}", 64,
          C::kDataLoss, {"tensor 'w'", "data_offsets [0, 96] exceed the data block (64 bytes)"}),
      Bad("OffsetsReversed",
          "{" + Entry("w", R"({"dtype":"F32","shape":[2],"data_offsets":[8,0]})") + "}", 8, kInv,
          {"tensor 'w'", "data_offsets [8, 0] are reversed"}),
      Bad("OffsetsWrongCount",
          "{" + Entry("w", R"({"dtype":"F32","shape":[2],"data_offsets":[0,8,8]})") + "}", 8, kInv,
          {"tensor 'w'", "'data_offsets' is a JSON array of 3 elements"}),
      Bad("OffsetsNegative",
          "{" + Entry("w", R"({"dtype":"F32","shape":[2],"data_offsets":[-8,0]})") + "}", 8, kInv,
          {"tensor 'w'", "data_offsets[0] is -8"}),
      // serde_json (Python's reader) parses "-0" as a float and rejects it; so do we.
      Bad("OffsetsMinusZero",
          "{" + Entry("w", R"({"dtype":"F32","shape":[2],"data_offsets":[-0,8]})") + "}", 8, kInv,
          {"tensor 'w'", "data_offsets[0] is -0"}),
      Bad("OffsetsNotNumbers",
          "{" + Entry("w", R"({"dtype":"F32","shape":[2],"data_offsets":["0","8"]})") + "}", 8,
          kInv, {"tensor 'w'", "data_offsets[0] is a JSON string"}),
      Bad("ShapeTimesDtypeMismatch",
          "{" + Entry("w", R"({"dtype":"F16","shape":[2,3],"data_offsets":[0,8]})") + "}", 8, kInv,
          {"tensor 'w'", "shape [2, 3] x F16 (2 bytes) = 12 bytes", "span 8 bytes"}),
      Bad("Overlap",
          "{" + Entry("first", R"({"dtype":"F32","shape":[4],"data_offsets":[0,16]})") + "," +
              Entry("second", R"({"dtype":"F32","shape":[4],"data_offsets":[8,24]})") + "}",
          24, kInv, {"'first' [0, 16]", "'second' [8, 24]", "overlap"}),
      Bad("UnknownDtype",
          "{" + Entry("w", R"({"dtype":"Q7","shape":[2],"data_offsets":[0,8]})") + "}", 8, kInv,
          {"tensor 'w'", "unknown dtype 'Q7'"}),
      Bad("UnsupportedDtypeI64",
          "{" + Entry("w", R"({"dtype":"I64","shape":[1],"data_offsets":[0,8]})") + "}", 8, kInv,
          {"tensor 'w'", "unsupported dtype 'I64'"}),
      Bad("UnsupportedDtypeBool",
          "{" + Entry("w", R"({"dtype":"BOOL","shape":[8],"data_offsets":[0,8]})") + "}", 8, kInv,
          {"tensor 'w'", "unsupported dtype 'BOOL'"}),
      Bad("DtypeNotString",
          "{" + Entry("w", R"({"dtype":4,"shape":[2],"data_offsets":[0,8]})") + "}", 8, kInv,
          {"tensor 'w'", "'dtype' is 4, expected a string"}),
      Bad("NegativeDim",
          "{" + Entry("w", R"({"dtype":"F32","shape":[-2,-1],"data_offsets":[0,8]})") + "}", 8,
          kInv, {"tensor 'w'", "shape[0] is -2, expected a non-negative integer"}),
      Bad("FractionalDim",
          "{" + Entry("w", R"({"dtype":"F32","shape":[2.5],"data_offsets":[0,8]})") + "}", 8, kInv,
          {"tensor 'w'", "shape[0] is 2.5"}),
      Bad("ShapeNotArray",
          "{" + Entry("w", R"({"dtype":"F32","shape":2,"data_offsets":[0,8]})") + "}", 8, kInv,
          {"tensor 'w'", "'shape' is 2, expected an array"}),
      Bad("MissingDtype", "{" + Entry("w", R"({"shape":[2],"data_offsets":[0,8]})") + "}", 8, kInv,
          {"tensor 'w'", "missing field 'dtype'"}),
      Bad("MissingShape", "{" + Entry("w", R"({"dtype":"F32","data_offsets":[0,8]})") + "}", 8,
          kInv, {"tensor 'w'", "missing field 'shape'"}),
      Bad("MissingOffsets", "{" + Entry("w", R"({"dtype":"F32","shape":[2]})") + "}", 8, kInv,
          {"tensor 'w'", "missing field 'data_offsets'"}),
      // 2^32 x 2^32 wraps to 0 in 64 bits: it must not pass as an empty tensor.
      Bad("HugeDimsOverflowInt64",
          "{" +
              Entry("w",
                    R"({"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]})") +
              "}",
          8, kInv, {"tensor 'w'", "more elements than fit in int64"}),
      Bad("DimBeyondInt64",
          "{" +
              Entry("w", R"({"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,0]})") +
              "}",
          8, kInv, {"tensor 'w'", "shape[0] is 18446744073709551615, larger than"}),
      // 2^62 elements fit int64, but 2^62 x 4 bytes wraps to 0.
      Bad("BytesOverflowUint64",
          "{" +
              Entry("w", R"({"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,0]})") +
              "}",
          8, kInv, {"tensor 'w'", "overflows a 64-bit size"}),
      Bad("MetadataNotObject", "{\"__metadata__\": [], " + ok_w + "}", 8, kInv,
          {"__metadata__ is a JSON array"}),
      Bad("MetadataValueNotString", "{\"__metadata__\": {\"n\": 3}, " + ok_w + "}", 8, kInv,
          {"__metadata__['n'] is 3, expected a string"}),
  };
  BadCase beyond{"HeaderLengthBeyondFile",
                 Image("{}", 0),
                 C::kDataLoss,
                 {"header length 1000 exceeds the 2 bytes", "truncated"}};
  SetHeaderLength(beyond.image, 1000);
  cases.push_back(std::move(beyond));
  return cases;
}

class SafetensorsBadInput : public ::testing::TestWithParam<BadCase> {};

TEST_P(SafetensorsBadInput, NamedError) {
  const BadCase& c = GetParam();
  auto file = Parse(c.image, "model.safetensors");
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), c.code) << file.status();
  EXPECT_TRUE(absl::StartsWith(file.status().message(), "model.safetensors: ")) << file.status();
  for (const std::string& f : c.fragments) EXPECT_TRUE(Contains(file.status().message(), f));
}

INSTANTIATE_TEST_SUITE_P(All, SafetensorsBadInput, ::testing::ValuesIn(BadCases()),
                         [](const auto& info) { return info.param.name; });

TEST(SafetensorsBadInputLimits, HeaderLongerThanLimit) {
  // The length fits in the buffer but is beyond any real header; reject before parsing 100 MB.
  std::vector<std::byte> image(8 + 100'000'001, std::byte{' '});
  SetHeaderLength(image, 100'000'001);
  auto file = Parse(image, "big.safetensors");
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(file.status().message(), "big.safetensors: header length 100000001"));
}

TEST(SafetensorsBadInputLimits, GapsBetweenTensorsAreAllowed) {
  // Not overlapping is all the format needs; Python writers never leave gaps, but others may.
  const std::string header =
      "{" + Entry("a", R"({"dtype":"F16","shape":[2],"data_offsets":[8,12]})") + "," +
      Entry("b", R"({"dtype":"F16","shape":[0],"data_offsets":[10,10]})") + "}";
  auto file = Parse(Image(header, 16), "gap.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->tensors().size(), 2u);
}

// --- Python interop ---------------------------------------------------------------------------

TEST(SafetensorsPython, PythonReadsCppFile) {
  TempDir dir;
  const std::string path = dir.File("cpp.safetensors");
  ASSERT_TRUE(
      WriteSafetensors(path, SampleTensors(), {{"format", "pt"}, {"note", "written by C++"}}).ok());
  const std::string script = R"PY(
import sys
import torch
from safetensors import safe_open
from safetensors.torch import load_file

path = sys.argv[1]
got = load_file(path)
want = {
    "a_f32": torch.tensor([[0.0, 1.5, -2.25], [3.0, 0.125, -7.0]], dtype=torch.float32),
    "b_f16": torch.tensor([1.0, -2.0, 0.5, 65504.0, 2.0**-24], dtype=torch.float16),
    "c_bf16": torch.tensor([[1.0, -2.0], [3.0, 0.15625]], dtype=torch.bfloat16),
    "scalar": torch.tensor(42.0, dtype=torch.float32),
    "empty": torch.zeros(0, 3, dtype=torch.float32),
}
bad = sorted(set(got) ^ set(want))
for k, w in want.items():
    g = got.get(k)
    if g is None or g.dtype != w.dtype or g.shape != w.shape or not torch.equal(g, w):
        bad.append(k)
        print("mismatch", k, g, w)
with safe_open(path, framework="pt") as f:
    md = f.metadata()
if md != {"format": "pt", "note": "written by C++"}:
    bad.append("__metadata__")
    print("metadata", md)
sys.exit(1 if bad else 0)
)PY";
  EXPECT_EQ(RunPython(dir, script, "'" + path + "'"), 0);
}

TEST(SafetensorsPython, CppReadsPythonFile) {
  TempDir dir;
  const std::string path = dir.File("py.safetensors");
  const std::string script = R"PY(
import sys
import torch
from safetensors.torch import save_file

save_file({
    "w32": torch.arange(6, dtype=torch.float32).reshape(2, 3) * 0.25 - 1.0,
    "w16": torch.tensor([1.0, -2.0, 0.5, 65504.0, 2.0**-24], dtype=torch.float16),
    "wbf": torch.tensor([[1.0, -2.0], [3.0, 0.15625]], dtype=torch.bfloat16),
    "s": torch.tensor(7.5),
    "e": torch.zeros(0, 4, dtype=torch.bfloat16),
}, sys.argv[1], metadata={"format": "pt", "author": "python"})
)PY";
  ASSERT_EQ(RunPython(dir, script, "'" + path + "'"), 0);

  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->metadata(),
            (std::map<std::string, std::string>{{"format", "pt"}, {"author", "python"}}));
  ASSERT_EQ((*file)->tensors().size(), 5u);

  const TensorView& w32 = (*file)->tensors().at("w32");
  EXPECT_EQ(w32.dtype, DType::kF32);
  EXPECT_EQ(w32.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(Values<float>(w32), (std::vector<float>{-1.0f, -0.75f, -0.5f, -0.25f, 0.0f, 0.25f}));

  const TensorView& w16 = (*file)->tensors().at("w16");
  EXPECT_EQ(w16.dtype, DType::kF16);
  EXPECT_EQ(Values<uint16_t>(w16), kF16);

  const TensorView& wbf = (*file)->tensors().at("wbf");
  EXPECT_EQ(wbf.dtype, DType::kBF16);
  EXPECT_EQ(wbf.shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(Values<uint16_t>(wbf), kBF16);

  const TensorView& s = (*file)->tensors().at("s");
  EXPECT_TRUE(s.shape.empty());
  EXPECT_EQ(Values<float>(s), std::vector<float>{7.5f});

  const TensorView& e = (*file)->tensors().at("e");
  EXPECT_EQ(e.dtype, DType::kBF16);
  EXPECT_EQ(e.shape, (std::vector<int64_t>{0, 4}));
  EXPECT_EQ(e.nbytes, 0u);
}

// float8_e4m3fn (F8_E4M3, the weights of block-wise FP8 checkpoints) both ways with Python's
// safetensors: 1, -2.5, 448 (the largest) and 2^-9 (the smallest subnormal) are the bytes 0x38,
// 0xC2, 0x7E and 0x01.
TEST(SafetensorsPython, Fp8E4m3BothWays) {
  TempDir dir;
  const std::string py = dir.File("py_f8.safetensors"), cpp = dir.File("cpp_f8.safetensors");
  const std::vector<uint8_t> bytes = {0x38, 0xC2, 0x7E, 0x01};
  ASSERT_TRUE(WriteSafetensors(cpp, {ToWrite("w", DType::kF8E4M3, {2, 2}, bytes)}).ok());
  const std::string script = R"PY(
import sys
import torch
from safetensors.torch import load_file, save_file

want = torch.tensor([[1.0, -2.5], [448.0, 2.0**-9]]).to(torch.float8_e4m3fn)
save_file({"w": want}, sys.argv[1])
got = load_file(sys.argv[2])["w"]
ok = got.dtype == torch.float8_e4m3fn and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
sys.exit(0 if ok else 1)
)PY";
  ASSERT_EQ(RunPython(dir, script, "'" + py + "' '" + cpp + "'"), 0);
  auto file = SafetensorsFile::Open(py);
  ASSERT_TRUE(file.ok()) << file.status();
  const TensorView& w = (*file)->tensors().at("w");
  EXPECT_EQ(w.dtype, DType::kF8E4M3);
  EXPECT_EQ(w.shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(w.nbytes, 4u);
  EXPECT_EQ(Values<uint8_t>(w), bytes);
}

// --- fuzz -------------------------------------------------------------------------------------

// Header mutations of a valid file. Every result must be a clean OK or a clean error: the loop
// exists to be run under -fsanitize=address,undefined, where an out-of-bounds read fails it.
class Mutator {
 public:
  Mutator(std::vector<std::byte> base, uint32_t seed) : base_(std::move(base)), rng_(seed) {}

  std::vector<std::byte> Next() {
    std::vector<std::byte> image = base_;
    switch (Uniform(0, 5)) {
      case 0:
        FlipHeaderBytes(image);
        break;
      case 1:
        image.resize(Uniform(0, image.size()));
        break;
      case 2:
        SetHeaderLength(image, RandomLength(image.size()));
        break;
      case 3:
        Splice(image, /*fix_length=*/true);
        break;
      case 4:
        Splice(image, /*fix_length=*/false);
        break;
      case 5:
        FlipDataByte(image);
        break;  // keeps the file valid
    }
    return image;
  }

 private:
  size_t Uniform(size_t lo, size_t hi) {
    return std::uniform_int_distribution<size_t>(lo, hi)(rng_);
  }

  void FlipHeaderBytes(std::vector<std::byte>& image) {
    const size_t end = 8 + HeaderLength(base_);
    for (size_t i = 0, n = Uniform(1, 4); i < n; ++i) {
      image[Uniform(0, end - 1)] ^= static_cast<std::byte>(1u << Uniform(0, 7));
    }
  }

  void FlipDataByte(std::vector<std::byte>& image) {
    const size_t begin = 8 + HeaderLength(base_);
    if (begin < image.size()) image[Uniform(begin, image.size() - 1)] ^= std::byte{0xff};
  }

  uint64_t RandomLength(size_t size) {
    switch (Uniform(0, 4)) {
      case 0:
        return std::uniform_int_distribution<uint64_t>()(rng_);
      case 1:
        return Uniform(0, size);
      case 2:
        return size - 7;  // one past the end
      case 3:
        return std::numeric_limits<uint64_t>::max() - Uniform(0, 8);
      default:
        return HeaderLength(base_) + Uniform(0, 16) - 8;
    }
  }

  // Replaces a short span of the header JSON with a snippet chosen to hit edge cases.
  void Splice(std::vector<std::byte>& image, bool fix_length) {
    static const char* const kSnippets[] = {
        "-1",
        "0",
        "1.5",
        "1e400",
        "18446744073709551616",
        "9223372036854775807",
        "4294967296",
        "\"F64\"",
        "\"BF16\"",
        "\"F16\"",
        "\"I64\"",
        "[]",
        "[0]",
        "[0,0]",
        "[1,0]",
        "[0,4,8]",
        "{}",
        "null",
        "true",
        "\"",
        "[",
        "{",
        "}",
        "]",
        ",",
        ":",
        "\"\\ud800\"",
        "\"\\u0000\"",
        "\xff",
        "\"__metadata__\"",
        "{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]}",
        "\"shape\"",
        "\"data_offsets\"",
        "\"dtype\"",
        "[[[[[[[[",
        "-0",
        "1e2",
        "\"x\":{}"};
    const size_t header_len = HeaderLength(base_);
    std::string header(reinterpret_cast<const char*>(image.data()) + 8, header_len);
    const size_t pos = Uniform(0, header.size());
    const size_t len = std::min(Uniform(0, 8), header.size() - pos);
    header.replace(pos, len, kSnippets[Uniform(0, std::size(kSnippets) - 1)]);
    std::vector<std::byte> out(8 + header.size() + (image.size() - 8 - header_len));
    std::memcpy(out.data() + 8, header.data(), header.size());
    std::memcpy(out.data() + 8 + header.size(), image.data() + 8 + header_len,
                image.size() - 8 - header_len);
    SetHeaderLength(out, fix_length ? header.size() : header_len);
    image = std::move(out);
  }

  std::vector<std::byte> base_;
  std::mt19937 rng_;
};

// Every byte of every accepted tensor is read into this, so the reads cannot be optimized away.
volatile unsigned g_sink = 0;

TEST(SafetensorsFuzz, RandomHeaderMutationsNeverCrash) {
  TempDir dir;
  const std::string path = dir.File("base.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, SampleTensors(), {{"format", "pt"}}).ok());
  Mutator mutator(ReadBytes(path), /*seed=*/20240611);

  int ok = 0, errors = 0;
  for (int i = 0; i < 20000; ++i) {
    // A fresh, exactly sized heap copy, so a sanitizer sees any read past the end.
    const std::vector<std::byte> image = mutator.Next();
    auto file = Parse(image, "fuzz");
    if (!file.ok()) {
      ++errors;
      ASSERT_TRUE(absl::StartsWith(file.status().message(), "fuzz: ")) << file.status();
      continue;
    }
    ++ok;
    for (const auto& [name, view] : (*file)->tensors()) {
      ASSERT_GE(view.data, image.data());
      ASSERT_LE(view.data + view.nbytes, image.data() + image.size()) << name;
      ASSERT_EQ(view.nbytes, static_cast<size_t>(view.numel()) * DTypeSize(view.dtype));
      for (size_t b = 0; b < view.nbytes; ++b) g_sink += static_cast<unsigned>(view.data[b]);
    }
  }
  std::cout << "fuzz: " << ok << " accepted, " << errors << " rejected\n";
  EXPECT_GT(ok, 1000);
  EXPECT_GT(errors, 1000);
}

// --- model.safetensors.index.json -------------------------------------------------------------

TEST(SafetensorsIndex, ParsesTheWeightMap) {
  auto index = ParseSafetensorsIndex(
      R"({"metadata": {"total_size": 10}, "weight_map": {"a": "m-2.safetensors",
          "b": "m-1.safetensors", "c": "m-2.safetensors", "d": "sub/m-3.safetensors"}})",
      "dir/model.safetensors.index.json");
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ(index->shards, (std::vector<std::string>{"m-1.safetensors", "m-2.safetensors",
                                                     "sub/m-3.safetensors"}));
  EXPECT_EQ(index->weight_map.at("c"), "m-2.safetensors");
}

// Shard names are read from a file: each way out of the model directory is refused, naming the
// file, the entry and the reason.
TEST(SafetensorsIndex, RefusesShardsOutsideTheDirectory) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"weight_map": {"w": "/etc/passwd"}})", "absolute path"},
      {R"({"weight_map": {"w": "../x.safetensors"}})", "'..'"},
      {R"({"weight_map": {"w": "a/../../x.safetensors"}})", "'..'"},
      {R"({"weight_map": {"w": "a/.."}})", "'..'"},
      {R"({"weight_map": {"w": ""}})", "empty file name"},
      {R"({"weight_map": {"w": "a\u0000b"}})", "NUL"},
      {R"({"weight_map": {"w": 3}})", "expected a file name"},
      {R"({"weight_map": []})", "no weight_map object"},
      {R"([1])", "expected an object"},
      {R"({"weight_map": {"w": "x")", "not valid JSON"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& [text, reason] = cases[i];
    auto index = ParseSafetensorsIndex(text, "dir/index.json");
    ASSERT_FALSE(index.ok()) << text;
    EXPECT_EQ(index.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_TRUE(absl::StartsWith(index.status().message(), "dir/index.json: ")) << index.status();
    EXPECT_TRUE(Contains(index.status().message(), reason)) << text;
    if (i < 7) {  // the cases about the entry "w" name it
      EXPECT_TRUE(Contains(index.status().message(), "weight_map entry \"w\"")) << index.status();
    }
  }
}

TEST(SafetensorsIndex, CheckpointFilePathsResolvesLinks) {
  TempDir dir, outside;
  ASSERT_TRUE(WriteSafetensors(outside.File("x.safetensors"), SampleTensors()).ok());
  ASSERT_TRUE(WriteSafetensors(dir.File("in.safetensors"), SampleTensors()).ok());
  fs::create_symlink(outside.File("x.safetensors"), dir.File("out.safetensors"));
  fs::create_symlink("in.safetensors", dir.File("alias.safetensors"));
  const auto write_index = [&](const std::string& shard) {
    std::ofstream(dir.File("model.safetensors.index.json"))
        << R"({"weight_map": {"t": ")" << shard << R"("}})";
  };
  write_index("alias.safetensors");
  auto paths = CheckpointFilePaths(dir.File(""));
  ASSERT_TRUE(paths.ok()) << paths.status();
  EXPECT_EQ(*paths, std::vector<std::string>{dir.File("alias.safetensors")});
  write_index("out.safetensors");
  paths = CheckpointFilePaths(dir.File(""));
  ASSERT_FALSE(paths.ok());
  EXPECT_TRUE(Contains(paths.status().message(), "weight_map entry \"t\"")) << paths.status();
  EXPECT_TRUE(Contains(paths.status().message(), "outside the model directory")) << paths.status();
  // Without an index: model.safetensors, or NotFound naming the directory.
  fs::remove(dir.File("model.safetensors.index.json"));
  EXPECT_EQ(CheckpointFilePaths(dir.File("")).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace lm
