// GPT-2's tokenizer files (data::GPT2Tokenizer from encoder.json and vocab.bpe). The input is encoder.json, a line
// "\n#vocab.bpe\n", vocab.bpe, "\n#text\n" and a text that a loaded tokenizer encodes and decodes.
#include "fuzz_util.h"
#include "loom/data/gpt2_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view in(reinterpret_cast<const char*>(data), size);
  auto [encoder, rest] = loom::fuzz::split(in, "\n#vocab.bpe\n");
  auto [merges, text_part] = loom::fuzz::split(rest, "\n#text\n");
  const std::string_view text = text_part;  // lambdas cannot capture structured bindings (clang 14)
  const std::string enc = loom::fuzz::write_scratch("encoder.json", encoder);
  const std::string bpe = loom::fuzz::write_scratch("vocab.bpe", merges);
  loom::fuzz::expect_only_loom_errors([&] {
    loom::data::GPT2Tokenizer tok(enc, bpe);
    std::vector<int32_t> ids = tok.encode(text);
    (void)tok.decode(ids);
  });
  return 0;
}
