// Training metric logs: JSON Lines (one object per step) and TensorBoard event files (tfrecord-framed Event protos
// encoded by hand, so no protobuf dependency), plus a reader of event files for tests and tools.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace loom::io {

// CRC-32C (Castagnoli), as tfrecord uses it; and tfrecord's masked form ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);
uint32_t masked_crc32c(const void* data, size_t size);

// Seconds since the epoch, as a double (the wall_time of events and metric lines).
double wall_time_now();

class AppendFileWriter;

// Appends one JSON object per line: {"step": s, "time": t, <name>: <value>, ...}, each line written at once so a
// crash loses nothing written. Non-finite values are written as null (JSON has no NaN). An existing file is
// continued, never truncated (a log holds earlier runs' lines).
class JsonlMetricsWriter {
 public:
  explicit JsonlMetricsWriter(const std::string& path);
  ~JsonlMetricsWriter();
  JsonlMetricsWriter(const JsonlMetricsWriter&) = delete;
  JsonlMetricsWriter& operator=(const JsonlMetricsWriter&) = delete;

  void write(int64_t step, const std::map<std::string, double>& values);
  // Marks where a run's lines start, so that runs appended to one file stay apart:
  // {"run_start": true, "step": s, "time": t} for a fresh run, with "resumed_from": "<checkpoint>" for a resumed one
  // (whose steps after s replace the earlier run's). `config` (a JSON object's text, when given) goes in as "config":
  // the run's whole configuration, so that a log says what made it.
  void write_run_start(int64_t step, const std::string& resumed_from = "", const std::string& config = "");
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::unique_ptr<AppendFileWriter> file_;
};

// Writes "<logdir>/events.out.tfevents.<seconds>.<host>.<pid>": a first event with file_version "brain.Event:2",
// then one event per add_scalar. The directory is created when missing.
class TensorBoardWriter {
 public:
  explicit TensorBoardWriter(const std::string& logdir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  void add_scalar(const std::string& tag, float value, int64_t step, double wall_time = wall_time_now());
  // The run's configuration for TensorBoard's HPARAMS tab: `config_json` is a JSON object, nested objects flattened
  // to "outer.inner" names; numbers, strings and bools as such (a session_start_info of the hparams plugin).
  void add_hparams(const std::string& config_json, double start_time = wall_time_now());
  void flush();
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& payload);

  std::string path_;
  std::unique_ptr<AppendFileWriter> file_;
};

// One decoded Event: the fields the writer produces.
struct TensorBoardEvent {
  double wall_time = 0;
  int64_t step = 0;
  std::string file_version;                        // set in the first event only
  std::vector<std::pair<std::string, float>> scalars;  // summary values (tag, simple_value)
  std::string plugin_tag, plugin_name, plugin_content;  // a value with plugin metadata instead (add_hparams)
};

// Parses an event file, checking both CRCs of every record. Throws loom::Error naming the file and the record on
// a truncated record, a CRC mismatch or a malformed proto.
std::vector<TensorBoardEvent> read_tensorboard_events(const std::string& path);

// Event proto encoding, exposed for tests: wall_time (1, double), step (2, varint), file_version (3, string),
// summary (5, message Summary { repeated Value value = 1 { tag = 1 string, simple_value = 2 float } }).
std::string encode_tensorboard_event(const TensorBoardEvent& event);
// tfrecord framing of one payload: length (u64 LE), masked CRC of the length, payload, masked CRC of the payload.
std::string frame_tfrecord(const std::string& payload);

}  // namespace loom::io
