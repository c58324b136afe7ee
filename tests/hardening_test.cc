// Regression tests for what the fuzz targets (tests/fuzz/) and the sanitizer build found in the parsers,
// and the pure pieces of "nothing lost": the checkpoint state parser and the cleanup of stale temporaries.
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "loom/common/error.h"
#include "loom/io/atomic_file.h"
#include "loom/io/safetensors.h"
#include "loom/train/trainer.h"
#include "test_files.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

std::string safetensors_bytes(const nlohmann::json& header, const std::string& data = "") {
  std::string h = header.dump();
  uint64_t n = h.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &n, 8);
  return out + h + data;
}

// fuzz_safetensors: a tensor of zero elements whose other sizes multiply past int64 passed the byte-count check
// (0 bytes) and overflowed computing its strides (UBSan: signed overflow in contiguous_strides).
TEST(Hardening, SafetensorsZeroElementShapesMustNotOverflowStrides) {
  test::TempDir dir;
  const std::string path = dir.file("zero.safetensors");
  const int64_t big = int64_t(1) << 40;
  test::write_all(path, safetensors_bytes({{"a", {{"dtype", "F32"}, {"shape", {0, big, big}}, {"data_offsets", {0, 0}}}}}));
  test::expect_error_mentioning([&] { io::load_safetensors_file(path); }, {"tensor \"a\"", "overflows"});
  // Zero elements with sizes that fit are fine.
  test::write_all(path, safetensors_bytes({{"a", {{"dtype", "F32"}, {"shape", {0, big}}, {"data_offsets", {0, 0}}}}}));
  io::SafetensorsFile f = io::load_safetensors_file(path);
  EXPECT_EQ(f.tensors.at("a").numel(), 0);
  EXPECT_EQ(f.tensors.at("a").size(1), big);
}

TEST(Hardening, CheckpointStateIsCheckedBeforeUse) {
  const nlohmann::json good = {{"step", 5},
                               {"loader", {{"shard_index", 1}, {"batch_offset", 2}, {"epoch", 3}, {"rng_state", 4}}},
                               {"rng", {{"seed", 6}, {"offset", 7}}}};
  train::CheckpointState st = train::parse_checkpoint_state(good.dump(), "c.safetensors");
  EXPECT_EQ(st.step, 5);
  EXPECT_EQ(st.shard_index, 1);
  EXPECT_EQ(st.batch_offset, 2);
  EXPECT_EQ(st.epoch, 3);
  EXPECT_EQ(st.loader_rng, 4u);
  EXPECT_EQ(st.rng_seed, 6u);
  EXPECT_EQ(st.rng_offset, 7u);
  auto bad = [&](nlohmann::json j, const std::string& what) {
    SCOPED_TRACE(j.dump());
    test::expect_error_mentioning([&] { train::parse_checkpoint_state(j.dump(), "c.safetensors"); },
                                  {"resume: 'c.safetensors' has corrupt state metadata", what});
  };
  auto j = good;
  j["step"] = -1;
  bad(j, "negative step");
  j = good;
  j["loader"]["batch_offset"] = -3;
  bad(j, "negative");
  j = good;
  j["step"] = "five";
  bad(j, "type");
  j = good;
  j["rng"].erase("offset");
  bad(j, "offset");
  j = good;
  j["loader"] = 3;
  bad(j, "");
  test::expect_error_mentioning([&] { train::parse_checkpoint_state("{\"step\": 1", "c.safetensors"); },
                                {"corrupt state metadata"});
  // Numbers that are not whole or do not fit: a float was converted without a check (1.7e59 is undefined
  // behaviour; fuzz_checkpoint found it), 3.5 became 3.
  j = good;
  j["loader"]["epoch"] = 1.6666e59;
  bad(j, "whole number");
  j = good;
  j["step"] = 3.5;
  bad(j, "whole number");
  j = good;
  j["rng"]["seed"] = -2;
  bad(j, "non-negative whole number");
  j = good;
  j["loader"]["shard_index"] = uint64_t(1) << 63;
  bad(j, "within 64 bits");
}

// Temporaries of killed writes: removed when older than `before` and their writer is gone; a running writer's, a
// fresh one and other files stay; a planted link is removed itself, never its target.
TEST(Hardening, StaleTemporariesAreRemovedAndNothingElse) {
  test::TempDir dir;
  const auto old_time = fs::file_time_type::clock::now() - std::chrono::hours(2);
  auto make = [&](const std::string& name, bool old) {
    const std::string p = dir.file(name);
    test::write_all(p, "partial");
    if (old) fs::last_write_time(p, old_time);
    return p;
  };
  const std::string dead = make(".loom.tmp.step_000001.safetensors.0.ab12", true);
  const std::string running = make(".loom.tmp.step_000002.safetensors." + std::to_string(::getppid()) + ".cd", true);
  const std::string fresh = make(".loom.tmp.step_000003.safetensors.0.ef", false);
  const std::string other = make("step_000001.safetensors.tmp.1.2", true);
  const std::string target = make("precious.txt", true);
  const std::string link = dir.file(".loom.tmp.latest.0.99");
  fs::create_symlink(target, link);
  const auto before = fs::file_time_type::clock::now() - std::chrono::hours(1);
  std::vector<std::string> removed = io::remove_stale_temporaries(dir.path().string(), before);
  std::sort(removed.begin(), removed.end());
  EXPECT_EQ(removed, (std::vector<std::string>{link, dead}));
  EXPECT_FALSE(fs::exists(dead));
  EXPECT_FALSE(fs::is_symlink(link));
  EXPECT_TRUE(fs::exists(running) && fs::exists(fresh) && fs::exists(other));
  EXPECT_EQ(test::read_all(target), "partial");
  // A writer's temporary carries the prefix, beside its target.
  io::AtomicFileWriter w(dir.file("x.bin"));
  EXPECT_EQ(fs::path(w.temp_path()).parent_path(), dir.path());
  EXPECT_EQ(fs::path(w.temp_path()).filename().string().rfind(std::string(io::kTempPrefix) + "x.bin.", 0), 0u);
  EXPECT_TRUE(io::remove_stale_temporaries((dir.path() / "missing").string(), before).empty());
}

}  // namespace
}  // namespace loom
