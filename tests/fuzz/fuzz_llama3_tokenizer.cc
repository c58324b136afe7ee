// LLaMA-3's tiktoken file (data::Llama3Tokenizer, any rank count). The input is the file, then "\n#text\n" and a
// text that a loaded tokenizer encodes (special tokens as text and as specials) and decodes.
#include "fuzz_util.h"
#include "loom/data/llama3_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view in(reinterpret_cast<const char*>(data), size);
  auto [file, text_part] = loom::fuzz::split(in, "\n#text\n");
  const std::string_view text = text_part;  // lambdas cannot capture structured bindings (clang 14)
  const std::string path = loom::fuzz::write_scratch("tokenizer.model", file);
  loom::fuzz::expect_only_loom_errors([&] {
    loom::data::Llama3Tokenizer tok(path, {/*num_base_tokens=*/0});
    std::vector<int32_t> ids = tok.encode(text);
    (void)tok.decode(ids);
    ids = tok.encode(text, loom::data::SpecialTokens::kAsIds);
    (void)tok.decode(ids);
  });
  return 0;
}
