// Safetensors header parsing: any byte string is a file image; SafetensorsFile::FromBuffer must
// either refuse it with an error naming the file, or return views that lie inside the image and
// whose sizes agree with shape x dtype, and that do not overlap.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "fuzz/fuzz_util.h"
#include "lm/io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // An exactly sized heap copy, so that ASan sees a read one byte past the end.
  std::unique_ptr<std::byte[]> image(new std::byte[size == 0 ? 1 : size]);
  if (size > 0) std::memcpy(image.get(), data, size);
  auto file = lm::SafetensorsFile::FromBuffer(nullptr, image.get(), size, "fuzz.safetensors");
  if (!file.ok()) {
    fuzz::CheckNamed(file.status(), "fuzz.safetensors: ");
    return 0;
  }
  const std::byte* begin = image.get();
  const std::byte* end = begin + size;
  std::vector<std::pair<const std::byte*, const std::byte*>> ranges;
  unsigned sum = 0;
  for (const auto& [name, view] : (*file)->tensors()) {
    FUZZ_CHECK(view.name == name, name);
    FUZZ_CHECK(view.data >= begin && view.data <= end, name);
    FUZZ_CHECK(view.nbytes <= static_cast<size_t>(end - view.data), name);
    FUZZ_CHECK(static_cast<uint64_t>(view.numel()) * lm::DTypeSize(view.dtype) == view.nbytes,
               name);
    for (size_t i = 0; i < view.nbytes; ++i) sum += static_cast<unsigned>(view.data[i]);
    if (view.nbytes > 0) ranges.emplace_back(view.data, view.data + view.nbytes);
    FUZZ_CHECK((*file)->Get(name).ok(), name);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i)
    FUZZ_CHECK(ranges[i].first >= ranges[i - 1].second, "overlapping tensors were accepted");
  volatile unsigned sink = sum;
  (void)sink;
  return 0;
}
