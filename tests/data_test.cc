// Token shards (llm.c format), the DataLoader (windows, shifting, shuffling, ranks, resume) and the GPT-2 tokenizer.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <sstream>

#include "loom/core/tensor.h"
#include "loom/data/gpt2_tokenizer.h"
#include "loom/data/loader.h"
#include "loom/data/token_file.h"
#include "test_files.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using test::expect_error_mentioning;
using test::read_all;
using test::TempDir;
using test::write_all;
using data::TokenWidth;


std::vector<int32_t> iota_tokens(int64_t n, int32_t base = 0) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = base + int32_t(i);
  return v;
}

std::vector<int32_t> header_ints(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<int32_t> h(256);
  in.read(reinterpret_cast<char*>(h.data()), 1024);
  return h;
}

// ---------------------------------------------------------------- token files

TEST(TokenFile, RoundTripUint16) {
  TempDir dir;
  std::vector<int32_t> tokens = {0, 1, 50256, 65535, 7, 42};
  const auto path = dir.file("a.bin");
  data::write_token_file(path, tokens);
  EXPECT_EQ(fs::file_size(path), 1024u + tokens.size() * 2);
  auto h = header_ints(path);
  EXPECT_EQ(h[0], 20240520);
  EXPECT_EQ(h[1], 1);
  EXPECT_EQ(h[2], int32_t(tokens.size()));
  for (int i = 3; i < 256; ++i) ASSERT_EQ(h[i], 0);
  auto info = data::read_token_file_info(path);
  EXPECT_EQ(info.width, TokenWidth::kU16);
  EXPECT_EQ(info.num_tokens, int64_t(tokens.size()));
  EXPECT_EQ(data::read_token_file(path), tokens);
  // Only the final file remains: the temporary was renamed, not left behind.
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1);
}

TEST(TokenFile, RoundTripUint32) {
  TempDir dir;
  std::vector<int32_t> tokens = {0, 65536, 128255, 2147483647, 3};
  const auto path = dir.file("b.bin");
  data::write_token_file(path, tokens, TokenWidth::kU32);
  EXPECT_EQ(fs::file_size(path), 1024u + tokens.size() * 4);
  auto h = header_ints(path);
  EXPECT_EQ(h[0], 20240801);
  EXPECT_EQ(h[1], 7);
  EXPECT_EQ(h[2], 5);
  EXPECT_EQ(data::read_token_file_info(path).width, TokenWidth::kU32);
  EXPECT_EQ(data::read_token_file(path), tokens);
}

TEST(TokenFile, EmptyAndRangedReads) {
  TempDir dir;
  data::write_token_file(dir.file("e.bin"), {});
  EXPECT_TRUE(data::read_token_file(dir.file("e.bin")).empty());
  auto tokens = iota_tokens(1001, 3);
  data::write_token_file(dir.file("r.bin"), tokens);
  data::TokenFileReader reader(dir.file("r.bin"));
  std::vector<int32_t> out(7);
  reader.read(994, 7, out.data());
  EXPECT_EQ(out, std::vector<int32_t>(tokens.begin() + 994, tokens.end()));
  EXPECT_THROW(reader.read(995, 7, out.data()), Error);
  EXPECT_THROW(reader.read(-1, 1, out.data()), Error);
}

TEST(TokenFile, WriteRejectsTokensThatDoNotFit) {
  TempDir dir;
  expect_error_mentioning([&] { data::write_token_file(dir.file("x.bin"), std::vector<int32_t>{1, 65536}); },
                          {dir.file("x.bin"), "65536", "uint16"});
  EXPECT_THROW(data::write_token_file(dir.file("x.bin"), std::vector<int32_t>{-1}), Error);
  EXPECT_THROW(data::write_token_file(dir.file("x.bin"), std::vector<int32_t>{-1}, TokenWidth::kU32), Error);
  EXPECT_FALSE(fs::exists(dir.file("x.bin")));  // a failed write leaves nothing
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 0);
}

TEST(TokenFile, ReadErrorsNameTheFileAndProblem) {
  TempDir dir;
  const auto missing = dir.file("missing.bin");
  expect_error_mentioning([&] { data::read_token_file(missing); }, {missing, "no such file"});

  const auto good = dir.file("good.bin");
  data::write_token_file(good, iota_tokens(100));

  const auto truncated = dir.file("truncated.bin");
  fs::copy_file(good, truncated);
  fs::resize_file(truncated, 1024 + 99 * 2 + 1);
  expect_error_mentioning([&] { data::read_token_file(truncated); }, {truncated, "size mismatch", "truncated"});

  const auto trailing = dir.file("trailing.bin");
  fs::copy_file(good, trailing);
  fs::resize_file(trailing, 1024 + 101 * 2);
  expect_error_mentioning([&] { data::read_token_file(trailing); }, {trailing, "size mismatch"});

  const auto short_header = dir.file("short_header.bin");
  fs::copy_file(good, short_header);
  fs::resize_file(short_header, 1000);
  expect_error_mentioning([&] { data::read_token_file_info(short_header); }, {short_header, "truncated"});

  auto patch_int = [](const std::string& path, int index, int32_t value) {
    std::fstream f(path, std::ios::binary | std::ios::in | std::ios::out);
    f.seekp(index * 4);
    f.write(reinterpret_cast<const char*>(&value), 4);
  };
  const auto bad_magic = dir.file("bad_magic.bin");
  fs::copy_file(good, bad_magic);
  patch_int(bad_magic, 0, 12345);
  expect_error_mentioning([&] { data::read_token_file(bad_magic); }, {bad_magic, "bad magic", "12345"});

  const auto bad_version = dir.file("bad_version.bin");
  fs::copy_file(good, bad_version);
  patch_int(bad_version, 1, 3);
  expect_error_mentioning([&] { data::read_token_file(bad_version); }, {bad_version, "version 3"});

  const auto bad_count = dir.file("bad_count.bin");
  fs::copy_file(good, bad_count);
  patch_int(bad_count, 2, 101);
  expect_error_mentioning([&] { data::read_token_file(bad_count); }, {bad_count, "101 tokens", "size mismatch"});
  patch_int(bad_count, 2, -5);
  expect_error_mentioning([&] { data::read_token_file(bad_count); }, {bad_count, "negative"});
}

// ---------------------------------------------------------------- loader

std::vector<int32_t> row(const Tensor& t, int64_t r) {
  auto all = to_vector<int32_t>(t);
  const int64_t T = t.size(1);
  return std::vector<int32_t>(all.begin() + r * T, all.begin() + (r + 1) * T);
}

// First token of each batch, which identifies the window it came from.
std::vector<int32_t> take_firsts(data::DataLoader& loader, int64_t n) {
  std::vector<int32_t> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(to_vector<int32_t>(loader.next().x)[0]);
  return out;
}

TEST(DataLoader, SequentialWindowsAndShiftedTargets) {
  TempDir dir;
  data::write_token_file(dir.file("s.bin"), iota_tokens(40));
  data::DataLoader loader(dir.file("s.bin"), {.batch_size = 2, .seq_len = 3});
  EXPECT_EQ(loader.batches_per_epoch(), (40 - 1) / 6);  // 6 windows
  EXPECT_EQ(loader.num_tokens(), 40);
  auto b = loader.next();
  EXPECT_EQ(b.x.shape(), (Shape{2, 3}));
  EXPECT_EQ(b.x.dtype(), kI32);
  EXPECT_TRUE(b.x.device().is_cpu());
  EXPECT_EQ(row(b.x, 0), (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(row(b.x, 1), (std::vector<int32_t>{3, 4, 5}));
  EXPECT_EQ(row(b.y, 0), (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(row(b.y, 1), (std::vector<int32_t>{4, 5, 6}));
  // The remaining windows follow every B*T tokens; the last one uses token 36 as its final target.
  EXPECT_EQ(take_firsts(loader, 5), (std::vector<int32_t>{6, 12, 18, 24, 30}));
  EXPECT_EQ(loader.epoch(), 1);
  auto again = loader.next();  // wraps to the start
  EXPECT_EQ(row(again.x, 0), (std::vector<int32_t>{0, 1, 2}));
  loader.reset();
  EXPECT_EQ(loader.epoch(), 0);
  EXPECT_EQ(take_firsts(loader, 2), (std::vector<int32_t>{0, 6}));
}

TEST(DataLoader, TokensOutsideTheVocabularyNameTheShard) {
  TempDir dir;
  std::vector<int32_t> tokens = iota_tokens(40);
  tokens[20] = 512;
  for (TokenWidth width : {TokenWidth::kU16, TokenWidth::kU32}) {
    data::write_token_file(dir.file("s.bin"), tokens, width);
    data::DataLoader loader(dir.file("s.bin"), {.batch_size = 2, .seq_len = 3, .vocab_size = 512});
    EXPECT_EQ(to_vector<int32_t>(loader.next().x)[0], 0);  // windows of tokens 0..6, 6..12, 12..18: all below 512
    loader.next();
    loader.next();
    try {
      loader.next();  // tokens 18..24
      FAIL() << "expected an error for token 512";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("s.bin: token 512 at index 20 is outside the model's vocabulary of 512"),
                std::string::npos)
          << e.what();
    }
    data::DataLoader unchecked(dir.file("s.bin"), {.batch_size = 2, .seq_len = 3});  // vocab_size 0: no check
    for (int i = 0; i < 6; ++i) unchecked.next();
  }
}

TEST(DataLoader, ManyShardsByGlobAndList) {
  TempDir dir;
  data::write_token_file(dir.file("d_train_000001.bin"), iota_tokens(13, 1000));
  data::write_token_file(dir.file("d_train_000000.bin"), iota_tokens(9, 0), TokenWidth::kU32);
  data::write_token_file(dir.file("other.bin"), iota_tokens(9, 5000));
  data::DataLoader loader(dir.file("d_train_*.bin"), {.batch_size = 1, .seq_len = 4});
  ASSERT_EQ(loader.paths().size(), 2u);
  EXPECT_EQ(loader.paths()[0], dir.file("d_train_000000.bin"));  // sorted
  EXPECT_EQ(loader.batches_per_epoch(), 2 + 3);
  EXPECT_EQ(take_firsts(loader, 6), (std::vector<int32_t>{0, 4, 1000, 1004, 1008, 0}));

  data::DataLoader listed(std::vector<std::string>{dir.file("other.bin"), dir.file("d_train_000000.bin")},
                          {.batch_size = 1, .seq_len = 4});
  EXPECT_EQ(take_firsts(listed, 4), (std::vector<int32_t>{5000, 5004, 0, 4}));
}

TEST(DataLoader, ShuffleIsSeededAndAPermutationPerEpoch) {
  TempDir dir;
  data::write_token_file(dir.file("a_0.bin"), iota_tokens(8 * 20 + 1, 0));
  data::write_token_file(dir.file("a_1.bin"), iota_tokens(8 * 13 + 1, 10000));
  data::DataLoaderOptions opt{.batch_size = 2, .seq_len = 4, .shuffle = true, .seed = 7};
  data::DataLoader a(dir.file("a_*.bin"), opt), b(dir.file("a_*.bin"), opt);
  const int64_t n = a.batches_per_epoch();
  ASSERT_EQ(n, 33);
  auto epoch0 = take_firsts(a, n);
  auto epoch1 = take_firsts(a, n);
  EXPECT_EQ(take_firsts(b, n), epoch0);  // same seed, same order

  data::DataLoader sequential(dir.file("a_*.bin"), {.batch_size = 2, .seq_len = 4});
  auto in_order = take_firsts(sequential, n);
  EXPECT_NE(epoch0, in_order);
  EXPECT_NE(epoch0, epoch1);  // a new order each epoch
  for (auto* e : {&epoch0, &epoch1}) {
    auto sorted = *e;
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(sorted, in_order);  // every window exactly once
  }
  // Shards are visited whole, one after the other, in shuffled order.
  auto shard_of = [](int32_t t) { return t >= 10000; };
  int switches = 0;
  for (int64_t i = 1; i < n; ++i) switches += shard_of(epoch0[size_t(i)]) != shard_of(epoch0[size_t(i - 1)]);
  EXPECT_EQ(switches, 1);

  opt.seed = 8;
  data::DataLoader c(dir.file("a_*.bin"), opt);
  EXPECT_NE(take_firsts(c, n), epoch0);
}

TEST(DataLoader, RanksTakeDisjointInterleavedWindows) {
  TempDir dir;
  const int64_t B = 2, T = 5, world = 3;
  data::write_token_file(dir.file("r.bin"), iota_tokens(B * T * 10 + 1));  // 10 windows: 3 groups of 3
  std::set<int32_t> seen;
  for (bool shuffle : {false, true}) {
    seen.clear();
    for (int64_t rank = 0; rank < world; ++rank) {
      data::DataLoader loader(dir.file("r.bin"),
                              {.batch_size = B, .seq_len = T, .rank = rank, .world_size = world, .shuffle = shuffle});
      ASSERT_EQ(loader.batches_per_epoch(), 3);
      auto firsts = take_firsts(loader, 3);
      for (size_t k = 0; k < firsts.size(); ++k) {
        const int32_t window = firsts[k] / int32_t(B * T);
        EXPECT_EQ(window % world, rank);  // rank r takes every world-th window
        if (!shuffle) {
          EXPECT_EQ(window, int32_t(k) * world + rank);
        }
        EXPECT_TRUE(seen.insert(firsts[k]).second) << "window read by two ranks";
      }
    }
    EXPECT_EQ(seen.size(), 9u);
  }
  EXPECT_THROW(data::DataLoader(dir.file("r.bin"), {.batch_size = B, .seq_len = T, .rank = 3, .world_size = 3}),
               Error);
}

TEST(DataLoader, PositionRestoresTheExactBatchSequence) {
  TempDir dir;
  data::write_token_file(dir.file("p_0.bin"), iota_tokens(6 * 7 + 1, 0));
  data::write_token_file(dir.file("p_1.bin"), iota_tokens(6 * 5 + 3, 20000));
  for (bool shuffle : {false, true}) {
    data::DataLoaderOptions opt{.batch_size = 3, .seq_len = 2, .shuffle = shuffle, .seed = 99};
    data::DataLoader loader(dir.file("p_*.bin"), opt);
    for (int skip : {0, 5, 11, 12, 30}) {
      loader.reset();
      take_firsts(loader, skip);
      const data::LoaderPosition saved = loader.position();
      std::vector<std::vector<int32_t>> expected;
      for (int i = 0; i < 15; ++i) {  // crosses shard and epoch boundaries
        auto b = loader.next();
        auto x = to_vector<int32_t>(b.x), y = to_vector<int32_t>(b.y);
        x.insert(x.end(), y.begin(), y.end());
        expected.push_back(x);
      }
      opt.seed = 12345;  // the saved position's rng_state wins over the new loader's seed
      data::DataLoader resumed(dir.file("p_*.bin"), opt);
      opt.seed = 99;
      resumed.set_position(saved);
      EXPECT_EQ(resumed.position(), saved);
      for (int i = 0; i < 15; ++i) {
        auto b = resumed.next();
        auto x = to_vector<int32_t>(b.x), y = to_vector<int32_t>(b.y);
        x.insert(x.end(), y.begin(), y.end());
        ASSERT_EQ(x, expected[size_t(i)]) << "shuffle=" << shuffle << " skip=" << skip << " batch " << i;
      }
    }
  }
}

TEST(DataLoader, Errors) {
  TempDir dir;
  data::write_token_file(dir.file("short.bin"), iota_tokens(12));
  // B*T+1 = 13 tokens are needed for one batch.
  expect_error_mentioning([&] { data::DataLoader(dir.file("short.bin"), {.batch_size = 3, .seq_len = 4}); },
                          {dir.file("short.bin"), "12 tokens", "13"});
  data::DataLoader ok(dir.file("short.bin"), {.batch_size = 1, .seq_len = 11});
  // Two ranks need 2*B*T+1 tokens.
  EXPECT_THROW(data::DataLoader(dir.file("short.bin"), {.batch_size = 1, .seq_len = 11, .rank = 1, .world_size = 2}),
               Error);
  expect_error_mentioning([&] { data::DataLoader(dir.file("none_*.bin"), {}); }, {"none_*.bin", "no files match"});
  expect_error_mentioning([&] { data::DataLoader(dir.file("absent.bin"), {}); }, {dir.file("absent.bin")});
  EXPECT_THROW(data::DataLoader(dir.file("short.bin"), {.batch_size = 0, .seq_len = 4}), Error);
  EXPECT_THROW(ok.set_position({.shard_index = 1}), Error);
  EXPECT_THROW(ok.set_position({.batch_offset = 1}), Error);
  EXPECT_THROW(ok.set_position({.epoch = -1}), Error);
}

// ---------------------------------------------------------------- GPT-2 tokenizer

// The vocabulary comes from scripts/fetch_gpt2_vocab.sh; without it these tests skip.
const data::GPT2Tokenizer* tokenizer() {
  static std::unique_ptr<data::GPT2Tokenizer> tok = []() -> std::unique_ptr<data::GPT2Tokenizer> {
    try {
      return std::make_unique<data::GPT2Tokenizer>();
    } catch (const Error&) {
      return nullptr;
    }
  }();
  return tok.get();
}

#define REQUIRE_TOKENIZER()                                                                              \
  if (!tokenizer()) GTEST_SKIP() << "GPT-2 vocabulary absent: run scripts/fetch_gpt2_vocab.sh"; \
  const data::GPT2Tokenizer& tok = *tokenizer()

std::string tinyshakespeare_path() {
  std::vector<fs::path> candidates;
  if (const char* d = std::getenv("LOOM_DATA_DIR"); d && *d) candidates.push_back(fs::path(d) / "tinyshakespeare.txt");
  if (const char* s = std::getenv("LOOM_SOURCE_DIR"); s && *s)
    candidates.push_back(fs::path(s) / ".." / "shared" / "data" / "tinyshakespeare.txt");
  candidates.push_back(fs::path(LOOM_SOURCE_DIR) / ".." / "shared" / "data" / "tinyshakespeare.txt");
  for (const auto& c : candidates)
    if (fs::exists(c)) return c.string();
  return "";
}


std::vector<std::string> pieces(std::string_view text) {
  std::vector<std::string> out;
  for (auto p : data::gpt2_pretokenize(text)) out.emplace_back(p);
  return out;
}

using Strings = std::vector<std::string>;

TEST(GPT2Pretokenize, SplitsLikeTheGPT2Regex) {
  EXPECT_EQ(pieces("Hello, world! It's"), (Strings{"Hello", ",", " world", "!", " It", "'s"}));
  // A whitespace run before a word gives up its last space to the word; "\n\n" before a word splits in two.
  EXPECT_EQ(pieces("  two  spaces\n\nnew"), (Strings{" ", " two", " ", " spaces", "\n", "\n", "new"}));
  EXPECT_EQ(pieces("end \n\n"), (Strings{"end", " \n\n"}));  // trailing whitespace stays whole
  EXPECT_EQ(pieces("'s's 're 'x"), (Strings{"'s", "'s", " '", "re", " '", "x"}));
  EXPECT_EQ(pieces("we'll I'M"), (Strings{"we", "'ll", " I", "'", "M"}));  // contractions are lowercase only
  EXPECT_EQ(pieces("abc123 4.5x"), (Strings{"abc", "123", " 4", ".", "5", "x"}));
  EXPECT_EQ(pieces("--> ...!?"), (Strings{"-->", " ...!?"}));
  EXPECT_EQ(pieces("café ½ Ωmega"), (Strings{"café", " ½", " Ωmega"}));
  EXPECT_EQ(pieces("a\u00a0b"), (Strings{"a", "\u00a0", "b"}));  // NBSP is whitespace, not a prefix space
  EXPECT_EQ(pieces("x\ty"), (Strings{"x", "\t", "y"}));
  EXPECT_EQ(pieces(""), Strings{});
  EXPECT_EQ(pieces(" "), Strings{" "});
}

TEST(GPT2Pretokenize, PiecesCoverAnyBytes) {
  std::mt19937 eng(1234);
  for (int trial = 0; trial < 200; ++trial) {
    std::string text(size_t(eng() % 64), '\0');
    for (auto& c : text) c = char(eng() % 4 == 0 ? ' ' : eng() % 256);  // random bytes, often invalid UTF-8
    std::string joined;
    for (auto p : data::gpt2_pretokenize(text)) {
      ASSERT_FALSE(p.empty());
      joined += p;
    }
    ASSERT_EQ(joined, text);
  }
}

TEST(GPT2Tokenizer, KnownEncodings) {
  REQUIRE_TOKENIZER();
  EXPECT_EQ(tok.vocab_size(), 50257);
  EXPECT_EQ(tok.eot_token(), 50256);
  EXPECT_EQ(tok.decode_token(50256), "<|endoftext|>");
  // encoder.json maps "Hello" to 15496, "Ġworld" (Ġ stands for the space byte) to 995, "Ġthe" to 262.
  EXPECT_EQ(tok.decode_token(15496), "Hello");
  EXPECT_EQ(tok.decode_token(995), " world");
  EXPECT_EQ(tok.decode_token(262), " the");
  EXPECT_EQ(tok.decode_token(198), "\n");  // "Ċ" is byte 10
  EXPECT_EQ(tok.encode("Hello world"), (std::vector<int32_t>{15496, 995}));
  EXPECT_EQ(tok.encode(" the"), (std::vector<int32_t>{262}));
  // Checked against gpt-3-encoder 1.1.4 (a port of OpenAI's encoder.py with the same regex and merges).
  EXPECT_EQ(tok.encode("Hello, world! It's 2024."), (std::vector<int32_t>{15496, 11, 995, 0, 632, 338, 48609, 13}));
  EXPECT_EQ(tok.encode("I'll be there\u2014won't you?"),
            (std::vector<int32_t>{40, 1183, 307, 612, 960, 26502, 470, 345, 30}));
  EXPECT_EQ(tok.encode("  two  spaces\n\nnew para\n"),
            (std::vector<int32_t>{220, 734, 220, 9029, 198, 198, 3605, 31215, 198}));
  EXPECT_EQ(tok.encode("na\u00efve caf\u00e9 \u00dcn\u00efc\u00f6d\u00e9 123 \u00bd"),
            (std::vector<int32_t>{2616, 38776, 40304, 49363, 77, 26884, 66, 9101, 67, 2634, 17031, 25208}));
  EXPECT_EQ(tok.encode("tab\there\r\nend   "), (std::vector<int32_t>{8658, 197, 1456, 201, 198, 437, 220, 220, 220}));
  EXPECT_EQ(tok.encode("x = 3.14159;\n  y"), (std::vector<int32_t>{87, 796, 513, 13, 1415, 19707, 26, 198, 220, 331}));
  EXPECT_TRUE(tok.encode("").empty());
  // Special tokens in text are plain text, as in GPT-2's encoder.
  EXPECT_NE(tok.encode("<|endoftext|>"), (std::vector<int32_t>{50256}));
}

TEST(GPT2Tokenizer, DecodeRoundTripsArbitraryBytes) {
  REQUIRE_TOKENIZER();
  std::mt19937 eng(99);
  for (int trial = 0; trial < 50; ++trial) {
    std::string text(size_t(eng() % 100), '\0');
    for (auto& c : text) c = char(eng() % 256);
    auto ids = tok.encode(text);
    ASSERT_EQ(tok.decode(ids), text);
  }
  EXPECT_THROW(tok.decode(std::vector<int32_t>{50257}), Error);
  EXPECT_THROW(tok.decode(std::vector<int32_t>{-1}), Error);
}

TEST(GPT2Tokenizer, TinyShakespeareMatchesReferenceAndRoundTrips) {
  REQUIRE_TOKENIZER();
  const std::string path = tinyshakespeare_path();
  if (path.empty()) GTEST_SKIP() << "tinyshakespeare.txt not found (set LOOM_DATA_DIR)";
  const std::string text = read_all(path);
  ASSERT_EQ(text.size(), 1115394u);
  const auto ids = tok.encode(text);
  EXPECT_EQ(tok.decode(ids), text);
  // Fingerprint of the whole encoding from gpt-3-encoder 1.1.4: count, sum and a polynomial hash.
  ASSERT_EQ(ids.size(), 338025u);
  uint64_t sum = 0, hash = 0;
  for (int32_t t : ids) {
    sum += uint64_t(t);
    hash = (hash * 1000003 + uint64_t(t)) % 4294967291ull;
  }
  EXPECT_EQ(sum, 1405356689u);
  EXPECT_EQ(hash, 132975861u);
  EXPECT_EQ(std::vector<int32_t>(ids.begin(), ids.begin() + 12),
            (std::vector<int32_t>{5962, 22307, 25, 198, 8421, 356, 5120, 597, 2252, 11, 3285, 502}));
  // Encoding in chunks gives the same tokens as encoding the whole text.
  std::vector<int32_t> chunked;
  const auto chunks = data::split_for_encoding(text, 50000);
  EXPECT_GT(chunks.size(), 10u);
  for (auto c : chunks) {
    auto part = tok.encode(c);
    chunked.insert(chunked.end(), part.begin(), part.end());
  }
  EXPECT_EQ(chunked, ids);
}

TEST(GPT2Tokenizer, MissingVocabularyTellsHowToFetchIt) {
  TempDir dir;
  expect_error_mentioning([&] { data::GPT2Tokenizer t(dir.file("nowhere")); },
                          {"nowhere", "scripts/fetch_gpt2_vocab.sh"});
  const char* old = std::getenv("HOME");
  const std::string saved_home = old ? old : "";
  const char* old_cache = std::getenv("LOOM_CACHE_DIR");
  const std::string saved_cache = old_cache ? old_cache : "";
  ::setenv("HOME", dir.file("home").c_str(), 1);
  ::setenv("LOOM_CACHE_DIR", dir.file("cache").c_str(), 1);
  expect_error_mentioning([&] { data::GPT2Tokenizer::find_vocab_dir(); },
                          {dir.file("cache"), dir.file("home"), "scripts/fetch_gpt2_vocab.sh"});
  if (old) ::setenv("HOME", saved_home.c_str(), 1); else ::unsetenv("HOME");
  if (old_cache) ::setenv("LOOM_CACHE_DIR", saved_cache.c_str(), 1); else ::unsetenv("LOOM_CACHE_DIR");
}

TEST(GPT2Tokenizer, CorruptVocabularyFiles) {
  TempDir dir;
  std::ofstream(dir.file("encoder.json")) << "{\"a\": 0, \"b\": ";
  std::ofstream(dir.file("vocab.bpe")) << "#version: 0.2\na b\n";
  expect_error_mentioning([&] { data::GPT2Tokenizer t(dir.file("encoder.json"), dir.file("vocab.bpe")); },
                          {dir.file("encoder.json"), "JSON"});
  std::ofstream(dir.file("encoder.json")) << "{\"a\": 0, \"b\": 1, \"ab\": 2, \"<|endoftext|>\": 3}";
  std::ofstream(dir.file("vocab.bpe")) << "#version: 0.2\nab\n";
  expect_error_mentioning([&] { data::GPT2Tokenizer t(dir.file("encoder.json"), dir.file("vocab.bpe")); },
                          {dir.file("vocab.bpe"), "line 2"});
  // A tiny consistent vocabulary works end to end.
  std::ofstream(dir.file("vocab.bpe")) << "#version: 0.2\na b\n";
  data::GPT2Tokenizer tiny(dir.file("encoder.json"), dir.file("vocab.bpe"));
  EXPECT_EQ(tiny.encode("abab"), (std::vector<int32_t>{2, 2}));
  EXPECT_EQ(tiny.eot_token(), 3);
}

}  // namespace
}  // namespace loom
