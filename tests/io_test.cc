// safetensors round trips and corrupt files, atomic writes, CRC32C, JSONL metrics and TensorBoard event files.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "loom/core/tensor.h"
#include "loom/io/atomic_file.h"
#include "loom/io/metrics_log.h"
#include "loom/io/safetensors.h"
#include "test_files.h"
#include "test_util.h"

namespace loom {
namespace {

using test::bytes_equal;

namespace fs = std::filesystem;
using test::expect_error_mentioning;
using test::read_all;
using test::TempDir;
using test::write_all;




// ---------------------------------------------------------------- atomic files

TEST(AtomicFile, CommitReplacesAndAbandonLeavesOldFile) {
  TempDir dir;
  const auto path = dir.file("f.txt");
  io::write_file_atomic(path, "first");
  EXPECT_EQ(read_all(path), "first");
  io::write_file_atomic(path, "second, longer");
  EXPECT_EQ(read_all(path), "second, longer");
  {
    io::AtomicFileWriter w(path);
    w.write(std::string(3 << 20, 'x'));  // bigger than the buffer
    EXPECT_TRUE(fs::exists(w.temp_path()));
    EXPECT_NE(w.temp_path().find(".tmp."), std::string::npos);
    // destroyed without commit: the old content stays and the temporary goes away
  }
  EXPECT_EQ(read_all(path), "second, longer");
  EXPECT_EQ(dir.count(), 1u);
  expect_error_mentioning([&] { io::write_file_atomic(dir.file("no/such/dir/f"), "x"); }, {"no/such/dir/f"});
}

// A link planted in the directory at a temporary name is never followed: the writer makes its own fresh file (the
// name was "<path>.tmp.<pid>", predictable, and opened without O_EXCL / O_NOFOLLOW).
TEST(AtomicFile, PlantedLinksAreNotFollowed) {
  TempDir dir;
  const auto path = dir.file("ckpt.safetensors");
  const auto victim = dir.file("victim.txt");
  write_all(victim, "precious");
  fs::create_symlink(victim, path + ".tmp." + std::to_string(::getpid()));
  for (int i = 0; i < 3; ++i) {
    io::AtomicFileWriter w(path);
    EXPECT_FALSE(fs::is_symlink(w.temp_path())) << w.temp_path();
    w.write("new contents");
    w.commit();
  }
  EXPECT_EQ(read_all(victim), "precious");
  EXPECT_EQ(read_all(path), "new contents");
}

// ---------------------------------------------------------------- safetensors

TEST(Safetensors, RoundTripEveryDtype) {
  TempDir dir;
  io::TensorMap tensors;
  for (DType dt : {kF32, kF64, kF16, kBF16, kI8, kU8, kI32, kI64, kBool}) {
    Tensor t = dt == kBool ? test::random_tensor({3, 5}, kF32, 0, 2).to(kI32).to(kBool)
               : is_floating(dt) ? test::random_tensor({3, 5}, dt, -100, 100)
                                 : test::random_tensor({3, 5}, kF64, 0, 100).to(dt);
    tensors[std::string("w_") + dtype_name(dt)] = t;
  }
  tensors["scalar"] = full({}, 2.5, kF32);
  tensors["empty"] = zeros({0, 4}, kBF16);
  tensors["odd"] = test::random_tensor({1, 7, 1}, kF16);
  tensors["strided"] = test::make_strided(test::random_tensor({4, 3}, kF32));  // saved by value, not by layout
  const auto path = dir.file("model.safetensors");
  io::save_safetensors(path, tensors, {{"format", "pt"}, {"step", "42"}});
  EXPECT_EQ(dir.count(), 1u);

  auto loaded = io::load_safetensors_file(path);
  EXPECT_EQ(loaded.metadata, (io::StringMap{{"format", "pt"}, {"step", "42"}}));
  ASSERT_EQ(loaded.tensors.size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    ASSERT_TRUE(loaded.tensors.count(name)) << name;
    const Tensor& l = loaded.tensors.at(name);
    EXPECT_TRUE(l.device().is_cpu());
    EXPECT_TRUE(l.is_contiguous());
    EXPECT_TRUE(bytes_equal(l, t)) << name << ": " << describe(l) << " vs " << describe(t);
  }

  // The header is what other readers expect: 8-byte length, JSON with dtype/shape/data_offsets, aligned data.
  const std::string bytes = read_all(path);
  uint64_t header_len;
  std::memcpy(&header_len, bytes.data(), 8);
  EXPECT_EQ(header_len % 8, 0u);
  auto header = nlohmann::json::parse(bytes.substr(8, header_len));
  EXPECT_EQ(header["w_bf16"]["dtype"], "BF16");
  EXPECT_EQ(header["w_bool"]["dtype"], "BOOL");
  EXPECT_EQ(header["w_f32"]["shape"], nlohmann::json::array({3, 5}));
  EXPECT_EQ(header["scalar"]["shape"], nlohmann::json::array());
  EXPECT_EQ(header["__metadata__"]["step"], "42");
  const auto offs = header["w_f64"]["data_offsets"];
  EXPECT_EQ(offs[1].get<uint64_t>() - offs[0].get<uint64_t>(), 15u * 8);
  EXPECT_TRUE(io::load_safetensors(path).count("w_i64"));
}

// Builds a file from a header JSON and a data section, for corrupt-file tests.
std::string make_file(const std::string& json, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t len = json.size();
  std::memcpy(out.data(), &len, 8);
  return out + json + data;
}

TEST(Safetensors, CorruptFilesGiveClearErrors) {
  TempDir dir;
  const auto path = dir.file("bad.safetensors");
  expect_error_mentioning([&] { io::load_safetensors(path); }, {path, "no such file"});

  write_all(path, "abc");
  expect_error_mentioning([&] { io::load_safetensors(path); }, {path, "truncated"});

  write_all(path, make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", "12345678").substr(0, 20));
  expect_error_mentioning([&] { io::load_safetensors(path); }, {path, "truncated", "header length"});

  std::string huge(8, '\xff');
  write_all(path, huge + "{}");
  expect_error_mentioning([&] { io::load_safetensors(path); }, {path, "header length"});

  write_all(path, make_file(R"({"a":{"dtype":"F32",)", ""));
  expect_error_mentioning([&] { io::load_safetensors(path); }, {path, "corrupt header"});

  write_all(path, make_file("[1, 2]", ""));
  expect_error_mentioning([&] { io::load_safetensors(path); }, {path, "not a JSON object"});

  const std::string eight(8, '\0');
  write_all(path, make_file(R"({"a":{"dtype":"F17","shape":[2],"data_offsets":[0,8]}})", eight));
  expect_error_mentioning([&] { io::load_safetensors(path); }, {"F17"});

  write_all(path, make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", eight));
  expect_error_mentioning([&] { io::load_safetensors(path); }, {path, "\"a\"", "outside the data section"});

  write_all(path, make_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight));
  expect_error_mentioning([&] { io::load_safetensors(path); }, {path, "\"a\"", "8 bytes", "needs 12"});

  write_all(path, make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", eight));
  expect_error_mentioning([&] { io::load_safetensors(path); }, {path, "data_offsets"});

  write_all(path, make_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", eight));
  expect_error_mentioning([&] { io::load_safetensors(path); }, {path, "negative"});

  write_all(path, make_file(R"({"a":{"dtype":"I32","shape":[2],"data_offsets":[0,8]},)"
                            R"("b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})",
                            eight));
  expect_error_mentioning([&] { io::load_safetensors(path); }, {path, "overlap"});

  write_all(path, make_file(R"({"a":{"dtype":"F32","shape":[2]}})", eight));
  expect_error_mentioning([&] { io::load_safetensors(path); }, {path, "data_offsets"});

  write_all(path, make_file(R"({"a":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}})", "\x01\x07"));
  expect_error_mentioning([&] { io::load_safetensors(path); }, {path, "BOOL"});

  // A valid file cut short: the last tensor's bytes run past the end.
  io::save_safetensors(dir.file("good.safetensors"), {{"w", test::random_tensor({64}, kF32)}});
  std::string good = read_all(dir.file("good.safetensors"));
  write_all(path, good.substr(0, good.size() - 10));
  expect_error_mentioning([&] { io::load_safetensors(path); }, {path, "truncated"});
}

// ---------------------------------------------------------------- CRC32C and metric logs

TEST(MetricsLog, Crc32cKnownVectors) {
  EXPECT_EQ(io::crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(io::crc32c("", 0), 0u);
  // RFC 3720 (iSCSI) test vectors: 32 zero bytes, 32 bytes of 0xFF, 0..31 ascending.
  std::string zeros(32, '\0'), ones(32, '\xff'), ascending(32, '\0');
  for (int i = 0; i < 32; ++i) ascending[size_t(i)] = char(i);
  EXPECT_EQ(io::crc32c(zeros.data(), 32), 0x8A9136AAu);
  EXPECT_EQ(io::crc32c(ones.data(), 32), 0x62A8AB43u);
  EXPECT_EQ(io::crc32c(ascending.data(), 32), 0x46DD794Eu);
  // Incremental computation equals one pass.
  EXPECT_EQ(io::crc32c("6789", 4, io::crc32c("12345", 5)), 0xE3069283u);
  const uint32_t crc = 0xE3069283u;
  EXPECT_EQ(io::masked_crc32c("123456789", 9), ((crc >> 15) | (crc << 17)) + 0xa282ead8u);
}

TEST(MetricsLog, JsonlLines) {
  TempDir dir;
  const auto path = dir.file("logs/metrics.jsonl");
  {
    io::JsonlMetricsWriter w(path);
    w.write(1, {{"loss", 3.5}, {"lr", 1e-4}});
    w.write(2, {{"loss", std::nan("")}});
  }
  {
    io::JsonlMetricsWriter w(path);
    w.write(3, {{"loss", 2.0}});
  }
  std::istringstream lines(read_all(path));
  std::vector<nlohmann::json> rows;
  for (std::string line; std::getline(lines, line);) rows.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0]["step"], 1);
  EXPECT_DOUBLE_EQ(rows[0]["loss"].get<double>(), 3.5);
  EXPECT_DOUBLE_EQ(rows[0]["lr"].get<double>(), 1e-4);
  EXPECT_GT(rows[0]["time"].get<double>(), 1.6e9);
  EXPECT_TRUE(rows[1]["loss"].is_null());
  EXPECT_EQ(rows[2]["step"], 3);
  io::JsonlMetricsWriter(path).write(9, {});  // a log is continued, never truncated
  const std::string after = read_all(path);
  EXPECT_EQ(std::count(after.begin(), after.end(), '\n'), 4);
}

TEST(MetricsLog, TensorBoardEventsParseBack) {
  TempDir dir;
  std::string path;
  {
    io::TensorBoardWriter w(dir.file("tb"));
    path = w.path();
    EXPECT_NE(fs::path(path).filename().string().find("events.out.tfevents."), std::string::npos);
    w.add_scalar("train/loss", 3.25f, 10, 1700000000.5);
    w.add_scalar("train/lr", 6e-4f, 10, 1700000000.5);
    w.add_scalar("val/loss", -1.5f, int64_t(1) << 40, 1700000001.0);
    w.flush();
  }
  auto events = io::read_tensorboard_events(path);
  ASSERT_EQ(events.size(), 4u);
  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  EXPECT_TRUE(events[0].scalars.empty());
  EXPECT_EQ(events[1].step, 10);
  EXPECT_EQ(events[1].wall_time, 1700000000.5);
  ASSERT_EQ(events[1].scalars.size(), 1u);
  EXPECT_EQ(events[1].scalars[0].first, "train/loss");
  EXPECT_EQ(events[1].scalars[0].second, 3.25f);
  EXPECT_EQ(events[2].scalars[0].second, 6e-4f);
  EXPECT_EQ(events[3].step, int64_t(1) << 40);
  EXPECT_EQ(events[3].scalars[0].first, "val/loss");

  // The exact bytes of one event, checked by hand against the protobuf wire format.
  io::TensorBoardEvent e;
  e.wall_time = 1.0;
  e.step = 300;
  e.scalars.emplace_back("a", 1.0f);
  const std::string expected = std::string("\x09\x00\x00\x00\x00\x00\x00\xf0\x3f", 9) +  // 1: double 1.0
                               std::string("\x10\xac\x02", 3) +                          // 2: varint 300
                               std::string("\x2a\x0a\x0a\x08", 4) +                      // 5: Summary{1: Value
                               std::string("\x0a\x01" "a", 3) +                          //   tag "a"
                               std::string("\x15\x00\x00\x80\x3f", 5);                   //   simple_value 1.0f}
  EXPECT_EQ(io::encode_tensorboard_event(e), expected);
  const std::string framed = io::frame_tfrecord(expected);
  ASSERT_EQ(framed.size(), 8 + 4 + expected.size() + 4);
  uint64_t len;
  std::memcpy(&len, framed.data(), 8);
  EXPECT_EQ(len, expected.size());

  // Corruption is caught by the CRCs; truncation by the framing.
  std::string bytes = read_all(path);
  std::string flipped = bytes;
  flipped[bytes.size() - 6] ^= 0x40;
  write_all(dir.file("flipped"), flipped);
  expect_error_mentioning([&] { io::read_tensorboard_events(dir.file("flipped")); }, {"record 3", "CRC"});
  write_all(dir.file("cut"), bytes.substr(0, bytes.size() - 3));
  expect_error_mentioning([&] { io::read_tensorboard_events(dir.file("cut")); }, {"record 3", "truncated"});
  std::string bad_len = bytes;
  bad_len[0] ^= 1;
  write_all(dir.file("bad_len"), bad_len);
  expect_error_mentioning([&] { io::read_tensorboard_events(dir.file("bad_len")); }, {"record 0", "length CRC"});
}

// The run's configuration: in metrics.jsonl's run-start line as "config", and for TensorBoard's HPARAMS tab as the
// hparams plugin's session_start_info (nested objects flattened to "outer.inner"; numbers, strings, bools).
TEST(MetricsLog, ConfigurationInTheLogAndAsHparams) {
  TempDir dir;
  const std::string config = R"({"settings": {"lr": 0.0006, "decay": "cosine", "shuffle": true, "val-data": ""},)"
                             R"( "model": {"n_layer": 2}})";
  const std::string jsonl = dir.file("metrics.jsonl");
  io::JsonlMetricsWriter(jsonl).write_run_start(0, "", config);
  const nlohmann::json line = nlohmann::json::parse(read_all(jsonl));
  EXPECT_EQ(line["config"], nlohmann::json::parse(config));
  std::string path;
  {
    io::TensorBoardWriter w(dir.file("tb"));
    path = w.path();
    w.add_hparams(config, 1700000000.0);
    w.add_scalar("train/loss", 2.5f, 1);
  }
  const auto events = io::read_tensorboard_events(path);
  ASSERT_EQ(events.size(), 3u);
  EXPECT_TRUE(events[1].scalars.empty());
  EXPECT_EQ(events[1].plugin_tag, "_hparams_/session_start_info");
  EXPECT_EQ(events[1].plugin_name, "hparams");
  const std::string& c = events[1].plugin_content;
  // version 0, session_start_info (3) holding map entries (1) of name (1) and google.protobuf.Value (2).
  EXPECT_EQ(c.substr(0, 3), std::string("\x08\x00\x1a", 3));
  for (const std::string name : {"settings.lr", "settings.decay", "settings.shuffle", "settings.val-data", "model.n_layer"})
    EXPECT_NE(c.find(std::string(1, char(name.size())) + name), std::string::npos) << name;
  double lr = 0.0006;
  EXPECT_NE(c.find("\x11" + std::string(reinterpret_cast<const char*>(&lr), 8)), std::string::npos);  // number_value
  EXPECT_NE(c.find(std::string("\x1a\x06" "cosine")), std::string::npos);                             // string_value
  EXPECT_NE(c.find(std::string("\x20\x01", 2)), std::string::npos);                                   // bool_value
  ASSERT_EQ(events[2].scalars.size(), 1u);
  EXPECT_EQ(events[2].scalars[0].first, "train/loss");
}

}  // namespace
}  // namespace loom
