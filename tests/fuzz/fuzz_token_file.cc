// llm.c token shards, uint16 and uint32 (data::read_token_file_info, read_token_file, TokenFileReader). The first
// input byte picks the width and whether the magic is forced (so most inputs reach the body checks).
#include <cstring>
#include <vector>

#include "fuzz_util.h"
#include "loom/data/token_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t mode = data[0];
  std::string bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  if ((mode & 2) && bytes.size() >= 8) {  // a valid magic and version of the chosen width
    const int32_t magic = (mode & 1) ? loom::data::kTokenMagicU32 : loom::data::kTokenMagicU16;
    const int32_t version = (mode & 1) ? loom::data::kTokenVersionU32 : loom::data::kTokenVersionU16;
    std::memcpy(bytes.data(), &magic, 4);
    std::memcpy(bytes.data() + 4, &version, 4);
  }
  const std::string path = loom::fuzz::write_scratch("t.bin", bytes);
  loom::fuzz::expect_only_loom_errors([&] {
    std::vector<int32_t> tokens = loom::data::read_token_file(path);
    (void)tokens;
  });
  loom::fuzz::expect_only_loom_errors([&] {
    loom::data::TokenFileReader r(path, /*token_limit=*/(mode & 4) ? 50257 : 0);
    std::vector<int32_t> out(64);
    const int64_t n = r.num_tokens();
    for (int64_t start = 0; start < n; start += 64) r.read(start, std::min<int64_t>(64, n - start), out.data());
    r.read(n > 0 ? n - 1 : 0, 2, out.data());  // past the end: must be an error, not a read out of bounds
  });
  return 0;
}
