// Paged decode attention (lm::PagedDecodeAttention, lm/model/paged_kv.h): the CPU kernel
// (kernels/cpu/paged_decode.h) and the CUDA kernel (kernels/cuda/paged_decode_cuda.h) against
// the gather + SDPA reference computed here in fp64, on random block tables: ragged lengths
// 1..2048 (split boundaries included), shared prompt blocks, block sizes 16 and 32, GQA 1/2/4/8
// (and 16, two passes of the CUDA kernel's query-head group), fp32 and bf16 pools. Rows that no
// sequence may read hold NaN, so a read past a length or through a wrong table entry shows.
//
// Tolerances (elementwise, |v| <= ~5 for randn values):
//   - fp32: the kernel's rounding is that of fp32 dot products over D and of sums over L tokens;
//     with u = 2^-24 it is of order u (sqrt(D) + sqrt(L)) max|v|, at most ~2e-5 at D = 64,
//     L = 2048 (3e-7 measured). Bound used: 4 u (D + sqrt(L)) max|v| (a few times the first form
//     with D in place of sqrt(D): the score errors are amplified by exp).
//   - bf16 (fp16 on CUDA): inputs are bf16 in the reference too, so the only extra error is the
//     output's rounding to bf16: half a bf16 ulp of the value, plus the fp32 bound.
// GPU cases skip without a device (tests/gpu.h); the CUDA kernel's two forms (CUDA cores,
// tensor cores: kernels/cuda/paged_decode.cuh) are each held to the same bound.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "lm/model/fast_paths.h"
#include "lm/model/paged_kv.h"
#include "tests/gpu.h"

namespace {

struct DecodeCase {
  torch::Tensor q, k_pool, v_pool, tables, lens;  // CPU, in the case's dtype / int32
  std::vector<std::vector<int32_t>> table_rows;
  std::vector<int64_t> lengths;
  int64_t block_size = 0;
};

// Lengths 1..max_len: both ends, block and split (1024) boundaries, the rest random.
std::vector<int64_t> RaggedLengths(int64_t n, int64_t max_len, int64_t bs, std::mt19937& rng) {
  // Sequences 0, 1 and 3 share blocks (MakeCase), so they get long lengths.
  std::vector<int64_t> fixed = {1024, max_len, 1, 1025, bs, bs + 1, 2 * bs - 1};
  std::uniform_int_distribution<int64_t> any(1, max_len);
  std::vector<int64_t> out;
  for (int64_t i = 0; i < n; ++i)
    out.push_back(i < static_cast<int64_t>(fixed.size()) ? std::min(fixed[i], max_len) : any(rng));
  return out;
}

// Sequences whose blocks are handed out shuffled from a pool with spare blocks; sequences 0 and
// 1 share their first `shared` blocks (a prompt's samples), so do 0 and 3 (a shorter prefix).
DecodeCase MakeCase(int64_t B, int64_t hq, int64_t hkv, int64_t d, int64_t bs,
                    torch::ScalarType dtype, uint32_t seed) {
  std::mt19937 rng(seed);
  torch::manual_seed(seed);
  DecodeCase c;
  c.block_size = bs;
  c.lengths = RaggedLengths(B, 2048, bs, rng);
  const int64_t shared = 5;
  c.lengths[0] = std::max<int64_t>(c.lengths[0], shared * bs + 3);
  c.lengths[1] = std::max<int64_t>(c.lengths[1], shared * bs + 1);
  if (B > 3) c.lengths[3] = std::max<int64_t>(c.lengths[3], 2 * bs + 7);
  int64_t needed = 0;
  for (int64_t len : c.lengths) needed += (len + bs - 1) / bs;
  const int64_t num_blocks = needed + 9;  // spare blocks that nobody reads
  std::vector<int32_t> ids(num_blocks - 1);
  std::iota(ids.begin(), ids.end(), 1);
  std::shuffle(ids.begin(), ids.end(), rng);
  size_t next = 0;
  int64_t width = 0;
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int32_t> t;
    for (int64_t i = 0; i < (c.lengths[b] + bs - 1) / bs; ++i) {
      const bool from_0 = (b == 1 && i < shared) || (b == 3 && i < 2);
      t.push_back(from_0 ? c.table_rows[0][i] : ids[next++]);
    }
    width = std::max<int64_t>(width, t.size());
    c.table_rows.push_back(t);
  }
  width += 2;  // padding (the null block) past every table
  c.tables = torch::zeros({B, width}, torch::kInt32);
  std::vector<uint8_t> readable(num_blocks * bs, 0);
  for (int64_t b = 0; b < B; ++b) {
    for (size_t i = 0; i < c.table_rows[b].size(); ++i) c.tables[b][i] = c.table_rows[b][i];
    for (int64_t p = 0; p < c.lengths[b]; ++p) readable[c.table_rows[b][p / bs] * bs + p % bs] = 1;
  }
  c.lens = torch::tensor(c.lengths).to(torch::kInt32);
  auto unread = torch::from_blob(readable.data(), {num_blocks, bs}, torch::kUInt8)
                    .to(torch::kBool)
                    .logical_not()
                    .view({num_blocks, bs, 1, 1});
  const double nan = std::numeric_limits<double>::quiet_NaN();
  auto pool = [&] {
    auto p = torch::randn({num_blocks, bs, hkv, d}).masked_fill(unread, nan);
    p[0].zero_();  // the null block
    return p.to(dtype);
  };
  c.k_pool = pool();
  c.v_pool = pool();
  c.q = torch::randn({B, hq, d}).to(dtype);
  return c;
}

// Gather + SDPA per sequence in fp64: K/V rows through the table into [Hkv, len, D].
torch::Tensor Reference(const DecodeCase& c, double scale) {
  const int64_t B = c.q.size(0), hkv = c.k_pool.size(2), d = c.k_pool.size(3);
  const int64_t bs = c.block_size;
  std::vector<torch::Tensor> out;
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int64_t> rows;
    for (int64_t p = 0; p < c.lengths[b]; ++p)
      rows.push_back(c.table_rows[b][p / bs] * bs + p % bs);
    auto idx = torch::tensor(rows);
    auto gather = [&](const torch::Tensor& pool) {
      return pool.reshape({-1, hkv, d}).index_select(0, idx).to(torch::kFloat64).transpose(0, 1);
    };
    auto q = c.q[b].to(torch::kFloat64).unsqueeze(1);  // [Hq, 1, D]
    auto o = at::scaled_dot_product_attention(q.unsqueeze(0), gather(c.k_pool).unsqueeze(0),
                                              gather(c.v_pool).unsqueeze(0), {}, 0.0, false, scale,
                                              /*enable_gqa=*/true);
    out.push_back(o.view({-1, d}));
  }
  return torch::stack(out);
}

// The largest |got - want| and whether every element is within its bound (see the header).
struct Error {
  double max_abs = 0.0;
  bool within = true;
};

Error Compare(const torch::Tensor& got, const torch::Tensor& want, const DecodeCase& c) {
  const double u = std::ldexp(1.0, -24);
  const int64_t d = c.k_pool.size(3);
  const double max_len = *std::max_element(c.lengths.begin(), c.lengths.end());
  const double vmax = c.v_pool.to(torch::kFloat64).nan_to_num(0.0).abs().max().item<double>();
  const double fp32_bound = 4 * u * (d + std::sqrt(max_len)) * vmax;
  auto g = got.to(torch::kCPU).to(torch::kFloat64), w = want.to(torch::kFloat64);
  auto err = (g - w).abs();
  auto bound = torch::full_like(w, fp32_bound);
  const bool bf16 = got.scalar_type() == torch::kBFloat16, fp16 = got.scalar_type() == torch::kHalf;
  if (bf16 || fp16) {
    // Half an ulp (7 or 10 mantissa bits) of the larger of the two (the rounding may cross a
    // binade).
    auto mag = torch::maximum(g.abs(), w.abs()).clamp_min(1e-30);
    bound = bound + torch::exp2(torch::floor(torch::log2(mag)) - (bf16 ? 7 : 10)) / 2;
  }
  Error e;
  e.max_abs = err.max().item<double>();
  e.within = (err <= bound).all().item<bool>() && !g.isnan().any().item<bool>();
  return e;
}

using Kernel = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                 const torch::Tensor&, const torch::Tensor&, double);

// Every case: block sizes 16 and 32, GQA 1/2/4/8/16, on `device` through `kernel`.
void CheckAgainstReference(Kernel kernel, torch::Device device, torch::ScalarType dtype,
                           int64_t d) {
  ASSERT_NE(kernel, nullptr);
  torch::NoGradGuard no_grad;
  double worst = 0.0;
  for (int64_t bs : {16, 32})
    for (int64_t group : {1, 2, 4, 8, 16}) {
      const int64_t hkv = group == 16 ? 1 : 2, hq = hkv * group;
      auto c = MakeCase(10, hq, hkv, d, bs, dtype, static_cast<uint32_t>(bs * 100 + group));
      const double scale = 1.0 / std::sqrt(static_cast<double>(d));
      auto got = kernel(c.q.to(device), c.k_pool.to(device), c.v_pool.to(device),
                        c.tables.to(device), c.lens.to(device), scale);
      ASSERT_TRUE(got.defined()) << "the kernel refused block size " << bs << " GQA " << group;
      EXPECT_EQ(got.scalar_type(), dtype);
      EXPECT_EQ(got.sizes(), c.q.sizes());
      const Error e = Compare(got, Reference(c, scale), c);
      EXPECT_TRUE(e.within) << "block size " << bs << " GQA " << group << " max error "
                            << e.max_abs;
      worst = std::max(worst, e.max_abs);
    }
  std::cout << "max |error| " << device << " " << dtype << " D " << d << ": " << worst << "\n";
}

Kernel CpuKernel() {
  return lm::FastPathsFor(torch::kCPU).paged_decode;
}

TEST(PagedDecode, CpuKernelEqualsReferenceFp32) {
  CheckAgainstReference(CpuKernel(), torch::kCPU, torch::kFloat32, 64);
}

TEST(PagedDecode, CpuKernelEqualsReferenceBf16) {
  CheckAgainstReference(CpuKernel(), torch::kCPU, torch::kBFloat16, 64);
}

// Head sizes that are not a multiple of 8 (the fixtures' 12) take the kernel's scalar tail.
TEST(PagedDecode, CpuKernelOddHeadDim) {
  CheckAgainstReference(CpuKernel(), torch::kCPU, torch::kFloat32, 12);
}

// The library fallback (devices without a kernel) meets the same bound.
TEST(PagedDecode, LibraryReferenceEqualsReference) {
  CheckAgainstReference(&lm::PagedDecodeAttentionReference, torch::kCPU, torch::kFloat32, 64);
}

// Tasks have a fixed split size, so the bits depend neither on the thread count nor on the other
// sequences of the batch.
TEST(PagedDecode, CpuKernelIsThreadAndBatchInvariant) {
  torch::NoGradGuard no_grad;
  auto c = MakeCase(8, 8, 2, 64, 16, torch::kFloat32, 7);
  const int threads = at::get_num_threads();
  auto run = [&](int n) {
    at::set_num_threads(n);
    return CpuKernel()(c.q, c.k_pool, c.v_pool, c.tables, c.lens, 0.125);
  };
  auto one = run(1), many = run(std::max(2, threads));
  at::set_num_threads(threads);
  EXPECT_TRUE(torch::equal(one, many));
  for (int64_t b : {0, 5}) {
    auto alone = CpuKernel()(c.q.narrow(0, b, 1), c.k_pool, c.v_pool, c.tables.narrow(0, b, 1),
                             c.lens.narrow(0, b, 1), 0.125);
    EXPECT_TRUE(torch::equal(alone[0], many[b])) << "sequence " << b;
  }
}

// A decode step's meta carries the device block tables and lengths and none of the varlen
// path's indices; PagedAttention then equals the reference.
TEST(PagedDecode, DecodeStepMetaBuildsNoGatherOrMask) {
  torch::NoGradGuard no_grad;
  auto c = MakeCase(6, 4, 2, 16, 16, torch::kFloat32, 11);
  lm::PagedStep step;
  step.cu_seqlens = {0};
  for (size_t b = 0; b < c.lengths.size(); ++b) {
    step.context_lens.push_back(c.lengths[b] - 1);
    step.cu_seqlens.push_back(static_cast<int64_t>(b) + 1);
    step.block_tables.push_back(c.table_rows[b]);
  }
  auto meta = lm::BuildPagedAttentionMeta(step, 16, torch::kCPU);
  EXPECT_TRUE(meta.decode);
  EXPECT_FALSE(meta.context_rows.defined());
  EXPECT_FALSE(meta.key_rows.defined());
  EXPECT_TRUE(meta.cu_seqlens.empty());
  EXPECT_EQ(meta.seq_lens.scalar_type(), torch::kInt32);
  EXPECT_EQ(meta.block_tables.scalar_type(), torch::kInt32);
  EXPECT_TRUE(torch::equal(meta.seq_lens, c.lens));
  // The new tokens' keys and values are read from the pools on this path: none are passed.
  auto got =
      lm::PagedAttention(c.q, torch::Tensor(), torch::Tensor(), c.k_pool, c.v_pool, meta, 0.25);
  const Error e = Compare(got, Reference(c, 0.25), c);
  EXPECT_TRUE(e.within) << e.max_abs;
}

// --- CUDA ---

Kernel CudaKernel() {
  return lm::FastPathsFor(torch::kCUDA).paged_decode;
}

TEST(PagedDecode, CudaKernelEqualsReference) {
  SKIP_WITHOUT_CUDA();
  for (int64_t d : {64, 128}) {
    CheckAgainstReference(CudaKernel(), torch::kCUDA, torch::kBFloat16, d);
    CheckAgainstReference(CudaKernel(), torch::kCUDA, torch::kFloat32, d);
  }
  CheckAgainstReference(CudaKernel(), torch::kCUDA, torch::kHalf, 256);
}

// OPD_PAGED_DECODE_CUDA set for the scope (the CUDA split kernel's form), restored after.
class ScopedPath {
 public:
  explicit ScopedPath(const char* path) {
    const char* old = std::getenv("OPD_PAGED_DECODE_CUDA");
    had_ = old != nullptr;
    if (had_) old_ = old;
    setenv("OPD_PAGED_DECODE_CUDA", path, 1);
  }
  ~ScopedPath() {
    if (had_) {
      setenv("OPD_PAGED_DECODE_CUDA", old_.c_str(), 1);
    } else {
      unsetenv("OPD_PAGED_DECODE_CUDA");
    }
  }

 private:
  bool had_ = false;
  std::string old_;
};

// Each form of the CUDA split kernel on every group (1, 2, 4, 8, 16): the CUDA cores for every
// dtype and head size, the tensor cores where they apply (bf16/fp16 q and pools, head_dim 64 or
// 128). The tensor cores carry P as a high and a low bf16 part, |p - (hi + lo)| <= 2^-18 p, which
// moves an output by at most 2^-18 max|v|: inside the fp32 bound of Compare (4 u (D + sqrt L)
// max|v| >= 2^-18 max|v| for D >= 16), so the same bound holds.
TEST(PagedDecode, CudaKernelBothFormsEqualReference) {
  SKIP_WITHOUT_CUDA();
  {
    ScopedPath path("cores");
    for (int64_t d : {64, 128, 256}) {
      CheckAgainstReference(CudaKernel(), torch::kCUDA, torch::kBFloat16, d);
      CheckAgainstReference(CudaKernel(), torch::kCUDA, torch::kFloat32, d);
    }
    CheckAgainstReference(CudaKernel(), torch::kCUDA, torch::kHalf, 128);
  }
  {
    ScopedPath path("tensor");
    for (int64_t d : {64, 128}) {
      CheckAgainstReference(CudaKernel(), torch::kCUDA, torch::kBFloat16, d);
      CheckAgainstReference(CudaKernel(), torch::kCUDA, torch::kHalf, d);
    }
  }
}

// The shapes the rollout decodes: Marco-Nano (16 query / 8 KV heads) and Qwen3-30B (32 / 4),
// head_dim 128, bf16, 24 sequences of ragged lengths up to 2048, both forms; the two forms agree
// with each other within twice the bound.
TEST(PagedDecode, CudaKernelAtModelShapes) {
  SKIP_WITHOUT_CUDA();
  torch::NoGradGuard no_grad;
  for (auto [hq, hkv] : {std::pair<int64_t, int64_t>{16, 8}, {32, 4}}) {
    auto c = MakeCase(24, hq, hkv, 128, 16, torch::kBFloat16, static_cast<uint32_t>(hq));
    const double scale = 1.0 / std::sqrt(128.0);
    const auto want = Reference(c, scale);
    torch::Tensor outs[2];
    int i = 0;
    for (const char* form : {"cores", "tensor"}) {
      ScopedPath path(form);
      outs[i] = CudaKernel()(c.q.cuda(), c.k_pool.cuda(), c.v_pool.cuda(), c.tables.cuda(),
                             c.lens.cuda(), scale);
      ASSERT_TRUE(outs[i].defined()) << form;
      const Error e = Compare(outs[i], want, c);
      EXPECT_TRUE(e.within) << hq << "/" << hkv << " " << form << " max error " << e.max_abs;
      std::cout << "Hq " << hq << " Hkv " << hkv << " " << form << ": max |error| " << e.max_abs
                << "\n";
      ++i;
    }
  }
}

// A pool of more than 2^31 elements, read at its far end: the kernel's offsets are 64-bit.
TEST(PagedDecode, CudaKernelPoolBeyond2To31Elements) {
  SKIP_WITHOUT_CUDA();
  torch::NoGradGuard no_grad;
  const int64_t bs = 16, hkv = 8, d = 128, hq = 32;
  const int64_t num_blocks = (int64_t{1} << 31) / (bs * hkv * d) + 64;  // 4.3 GB per bf16 pool
  auto opts = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  auto k_pool = torch::empty({num_blocks, bs, hkv, d}, opts);
  auto v_pool = torch::empty({num_blocks, bs, hkv, d}, opts);
  const int64_t len = 40 * bs, first = num_blocks - 40;  // the last 40 blocks
  k_pool.narrow(0, first, 40).normal_();
  v_pool.narrow(0, first, 40).normal_();
  auto tables = torch::arange(first, num_blocks, torch::kInt32).view({1, 40}).to(torch::kCUDA);
  auto lens = torch::full({1}, len, torch::kInt32).to(torch::kCUDA);
  auto q = torch::randn({1, hq, d}, opts);
  auto got = CudaKernel()(q, k_pool, v_pool, tables, lens, 0.088);
  ASSERT_TRUE(got.defined());
  auto want = lm::PagedDecodeAttentionReference(
      q.to(torch::kFloat32), k_pool.narrow(0, first, 40).to(torch::kFloat32),
      v_pool.narrow(0, first, 40).to(torch::kFloat32), (tables - static_cast<int32_t>(first)), lens,
      0.088);
  EXPECT_LE((got.to(torch::kFloat32) - want).abs().max().item<double>(), 2e-2);
}

}  // namespace
