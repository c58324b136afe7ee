// JSONL and TensorBoard metric writers; the protobuf wire format is small enough to write by hand.
#include "loom/io/metrics_log.h"

#include "loom/io/atomic_file.h"

#include <unistd.h>

#include <array>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "loom/common/error.h"

namespace loom::io {
namespace {

static_assert(std::endian::native == std::endian::little, "tfrecord framing is little-endian");

std::array<uint32_t, 256> make_crc32c_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;  // reflected Castagnoli polynomial
    table[i] = c;
  }
  return table;
}

// Protobuf wire types.
constexpr int kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5;

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out += char(uint8_t(v) | 0x80);
    v >>= 7;
  }
  out += char(v);
}
void put_tag(std::string& out, int field, int wire_type) { put_varint(out, uint64_t(field << 3 | wire_type)); }
void put_bytes_field(std::string& out, int field, const std::string& bytes) {
  put_tag(out, field, kLengthDelimited);
  put_varint(out, bytes.size());
  out += bytes;
}
template <typename T>
void put_fixed(std::string& out, T value) {
  char buf[sizeof(T)];
  std::memcpy(buf, &value, sizeof(T));
  out.append(buf, sizeof(T));
}

// A cursor over one proto message; throws through `fail` with context on malformed input.
struct ProtoReader {
  const std::string& data;
  size_t pos;
  size_t end;
  std::string context;

  [[noreturn]] void fail(const std::string& what) const { LOOM_THROW(context, ": malformed Event proto: ", what); }
  bool done() const { return pos >= end; }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos >= end) fail("truncated varint");
      const auto b = uint8_t(data[pos++]);
      v |= uint64_t(b & 0x7F) << shift;
      if (!(b & 0x80)) return v;
    }
    fail("varint longer than 10 bytes");
  }
  template <typename T>
  T fixed() {
    if (end - pos < sizeof(T)) fail("truncated fixed-width field");
    T v;
    std::memcpy(&v, data.data() + pos, sizeof(T));
    pos += sizeof(T);
    return v;
  }
  ProtoReader sub() {  // a length-delimited field as its own reader
    const uint64_t len = varint();
    if (len > end - pos) fail("length-delimited field runs past its message");
    ProtoReader r{data, pos, pos + size_t(len), context};
    pos += size_t(len);
    return r;
  }
  void skip(int wire_type) {
    switch (wire_type) {
      case kVarint: varint(); break;
      case kFixed64: fixed<uint64_t>(); break;
      case kLengthDelimited: sub(); break;
      case kFixed32: fixed<uint32_t>(); break;
      default: fail("unknown wire type " + std::to_string(wire_type));
    }
  }
};

TensorBoardEvent decode_event(const std::string& payload, const std::string& context) {
  TensorBoardEvent event;
  ProtoReader r{payload, 0, payload.size(), context};
  while (!r.done()) {
    const uint64_t key = r.varint();
    const int field = int(key >> 3), wire = int(key & 7);
    if (field == 1 && wire == kFixed64) {
      event.wall_time = r.fixed<double>();
    } else if (field == 2 && wire == kVarint) {
      event.step = int64_t(r.varint());
    } else if (field == 3 && wire == kLengthDelimited) {
      ProtoReader s = r.sub();
      event.file_version.assign(payload, s.pos, s.end - s.pos);
    } else if (field == 5 && wire == kLengthDelimited) {
      ProtoReader summary = r.sub();
      while (!summary.done()) {
        const uint64_t skey = summary.varint();
        if ((skey >> 3) != 1 || (skey & 7) != kLengthDelimited) {
          summary.skip(int(skey & 7));
          continue;
        }
        ProtoReader value = summary.sub();
        std::string tag;
        float simple_value = 0;
        bool has_simple_value = false;
        while (!value.done()) {
          const uint64_t vkey = value.varint();
          if ((vkey >> 3) == 1 && (vkey & 7) == kLengthDelimited) {
            ProtoReader t = value.sub();
            tag.assign(payload, t.pos, t.end - t.pos);
          } else if ((vkey >> 3) == 2 && (vkey & 7) == kFixed32) {
            simple_value = value.fixed<float>();
            has_simple_value = true;
          } else if ((vkey >> 3) == 9 && (vkey & 7) == kLengthDelimited) {  // SummaryMetadata
            ProtoReader meta = value.sub();
            while (!meta.done()) {
              const uint64_t mkey = meta.varint();
              if ((mkey >> 3) != 1 || (mkey & 7) != kLengthDelimited) {
                meta.skip(int(mkey & 7));
                continue;
              }
              ProtoReader plugin = meta.sub();  // PluginData { plugin_name = 1; content = 2 }
              while (!plugin.done()) {
                const uint64_t pkey = plugin.varint();
                if ((pkey & 7) != kLengthDelimited || ((pkey >> 3) != 1 && (pkey >> 3) != 2)) {
                  plugin.skip(int(pkey & 7));
                  continue;
                }
                ProtoReader f = plugin.sub();
                ((pkey >> 3) == 1 ? event.plugin_name : event.plugin_content).assign(payload, f.pos, f.end - f.pos);
              }
            }
          } else {
            value.skip(int(vkey & 7));
          }
        }
        if (has_simple_value) event.scalars.emplace_back(std::move(tag), simple_value);
        else event.plugin_tag = std::move(tag);
      }
    } else {
      r.skip(wire);
    }
  }
  return event;
}

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0 || !buf[0]) return "localhost";
  return buf;
}

}  // namespace

uint32_t crc32c(const void* data, size_t size, uint32_t crc) {
  static const std::array<uint32_t, 256> table = make_crc32c_table();
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  for (size_t i = 0; i < size; ++i) crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

uint32_t masked_crc32c(const void* data, size_t size) {
  const uint32_t crc = crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

double wall_time_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// ---- JSONL ----

JsonlMetricsWriter::JsonlMetricsWriter(const std::string& path) : path_(path) {
  std::error_code ec;
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  file_ = std::make_unique<AppendFileWriter>(path);  // never over a file this run read, never a device
}

JsonlMetricsWriter::~JsonlMetricsWriter() = default;

void JsonlMetricsWriter::write_run_start(int64_t step, const std::string& resumed_from, const std::string& config) {
  nlohmann::ordered_json line;
  line["run_start"] = true;
  line["step"] = step;
  line["time"] = wall_time_now();
  if (!resumed_from.empty()) line["resumed_from"] = resumed_from;
  if (!config.empty()) line["config"] = nlohmann::ordered_json::parse(config);
  file_->write(line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
}

void JsonlMetricsWriter::write(int64_t step, const std::map<std::string, double>& values) {
  nlohmann::ordered_json line;
  line["step"] = step;
  line["time"] = wall_time_now();
  for (const auto& [name, value] : values) {
    if (std::isfinite(value))
      line[name] = value;
    else
      line[name] = nullptr;
  }
  file_->write(line.dump() + "\n");
}

// ---- TensorBoard ----

std::string encode_tensorboard_event(const TensorBoardEvent& event) {
  std::string out;
  put_tag(out, 1, kFixed64);
  put_fixed(out, event.wall_time);
  put_tag(out, 2, kVarint);
  put_varint(out, uint64_t(event.step));
  if (!event.file_version.empty()) put_bytes_field(out, 3, event.file_version);
  if (!event.scalars.empty()) {
    std::string summary;
    for (const auto& [tag, value] : event.scalars) {
      std::string v;
      put_bytes_field(v, 1, tag);
      put_tag(v, 2, kFixed32);
      put_fixed(v, value);
      put_bytes_field(summary, 1, v);
    }
    put_bytes_field(out, 5, summary);
  }
  return out;
}

std::string frame_tfrecord(const std::string& payload) {
  std::string out;
  const uint64_t len = payload.size();
  put_fixed(out, len);
  put_fixed(out, masked_crc32c(&len, sizeof(len)));
  out += payload;
  put_fixed(out, masked_crc32c(payload.data(), payload.size()));
  return out;
}

TensorBoardWriter::TensorBoardWriter(const std::string& logdir) {
  std::error_code ec;
  std::filesystem::create_directories(logdir, ec);
  LOOM_REQUIRE(!ec, "TensorBoardWriter: cannot create ", logdir, ": ", ec.message());
  const auto seconds = int64_t(wall_time_now());
  const std::string base = (std::filesystem::path(logdir) / ("events.out.tfevents." + std::to_string(seconds) + "." +
                                                             host_name() + "." + std::to_string(::getpid())))
                               .string();
  // A second writer of this process in the same second gets a name of its own (TensorBoard reads every
  // events.out.tfevents.* file), never the first one's file.
  path_ = base;
  for (int n = 1; std::filesystem::exists(path_, ec) && n < 1000; ++n) path_ = base + "." + std::to_string(n);
  file_ = std::make_unique<AppendFileWriter>(path_, /*fresh=*/true);  // this run's own file
  TensorBoardEvent first;
  first.wall_time = wall_time_now();
  first.file_version = "brain.Event:2";
  write_record(encode_tensorboard_event(first));
  flush();
}

TensorBoardWriter::~TensorBoardWriter() = default;

namespace {

// google.protobuf.Value: number_value = 2 (double), string_value = 3, bool_value = 4.
std::string hparam_value(const nlohmann::json& v) {
  std::string out;
  if (v.is_boolean()) {
    put_tag(out, 4, kVarint);
    put_varint(out, v.get<bool>() ? 1 : 0);
  } else if (v.is_number()) {
    put_tag(out, 2, kFixed64);
    put_fixed(out, v.get<double>());
  } else {
    put_bytes_field(out, 3, v.is_string() ? v.get<std::string>() : v.dump(-1, ' ', false,
                                                                           nlohmann::json::error_handler_t::replace));
  }
  return out;
}

// Objects flattened to "outer.inner" names; arrays and null as their JSON text.
void flatten(const std::string& prefix, const nlohmann::json& j, std::vector<std::pair<std::string, nlohmann::json>>& out) {
  if (!j.is_object()) {
    out.emplace_back(prefix, j.is_null() ? nlohmann::json("null") : j);
    return;
  }
  for (const auto& [key, value] : j.items()) flatten(prefix.empty() ? key : prefix + "." + key, value, out);
}

}  // namespace

void TensorBoardWriter::add_hparams(const std::string& config_json, double start_time) {
  std::vector<std::pair<std::string, nlohmann::json>> flat;
  flatten("", nlohmann::json::parse(config_json), flat);
  // HParamsPluginData { version = 1; session_start_info = 3 { map<string, Value> hparams = 1;
  // start_time_secs = 5 } }, as TensorBoard's hparams summary writes it.
  std::string start_info;
  for (const auto& [name, value] : flat) {
    std::string entry;
    put_bytes_field(entry, 1, name);
    put_bytes_field(entry, 2, hparam_value(value));
    put_bytes_field(start_info, 1, entry);
  }
  put_tag(start_info, 5, kFixed64);
  put_fixed(start_info, start_time);
  std::string plugin_data;
  put_tag(plugin_data, 1, kVarint);
  put_varint(plugin_data, 0);
  put_bytes_field(plugin_data, 3, start_info);
  std::string plugin;  // PluginData { plugin_name = 1; content = 2 }
  put_bytes_field(plugin, 1, "hparams");
  put_bytes_field(plugin, 2, plugin_data);
  std::string metadata;  // SummaryMetadata { plugin_data = 1 }
  put_bytes_field(metadata, 1, plugin);
  std::string value;  // Summary.Value { tag = 1; metadata = 9 }
  put_bytes_field(value, 1, "_hparams_/session_start_info");
  put_bytes_field(value, 9, metadata);
  std::string summary;
  put_bytes_field(summary, 1, value);
  std::string event;
  put_tag(event, 1, kFixed64);
  put_fixed(event, start_time);
  put_tag(event, 2, kVarint);
  put_varint(event, 0);
  put_bytes_field(event, 5, summary);
  write_record(event);
}

void TensorBoardWriter::write_record(const std::string& payload) { file_->write(frame_tfrecord(payload)); }

void TensorBoardWriter::add_scalar(const std::string& tag, float value, int64_t step, double wall_time) {
  TensorBoardEvent event;
  event.wall_time = wall_time;
  event.step = step;
  event.scalars.emplace_back(tag, value);
  write_record(encode_tensorboard_event(event));
}

void TensorBoardWriter::flush() {}  // every record is handed to the system as it is written

std::vector<TensorBoardEvent> read_tensorboard_events(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  LOOM_REQUIRE(in, "read_tensorboard_events: cannot open ", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  const std::string data = ss.str();
  std::vector<TensorBoardEvent> events;
  size_t pos = 0;
  for (int64_t record = 0; pos < data.size(); ++record) {
    const std::string where = "read_tensorboard_events: " + path + ": record " + std::to_string(record);
    LOOM_REQUIRE(data.size() - pos >= 12, where, ": truncated length header");
    uint64_t len;
    uint32_t len_crc;
    std::memcpy(&len, data.data() + pos, 8);
    std::memcpy(&len_crc, data.data() + pos + 8, 4);
    LOOM_REQUIRE(len_crc == masked_crc32c(&len, 8), where, ": length CRC mismatch (corrupt file)");
    pos += 12;
    LOOM_REQUIRE(data.size() - pos >= 4 && len <= data.size() - pos - 4, where, ": truncated (", len,
                 "-byte payload runs past the end)");
    std::string payload = data.substr(pos, size_t(len));
    uint32_t data_crc;
    std::memcpy(&data_crc, data.data() + pos + len, 4);
    LOOM_REQUIRE(data_crc == masked_crc32c(payload.data(), payload.size()), where, ": data CRC mismatch (corrupt file)");
    pos += size_t(len) + 4;
    events.push_back(decode_event(payload, where));
  }
  return events;
}

}  // namespace loom::io
