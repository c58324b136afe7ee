// Op traces (loom/dispatch_modes.h, op_trace.h): every dispatched call recorded through the mode hook, identical
// calls counted once, written as JSON with an optional safetensors file of input values; and the reader that
// loom-conformance --trace replays from.
//
// The file (format "loom-op-trace", version 1; docs/PROVIDERS.md):
//   {"format": "loom-op-trace", "format_version": 1, "loom_version": "0.1.0",
//    "values": {"file": "run.trace.values.safetensors", "limit": 65536} | null,
//    "calls": [{"op": "gemm", "device": "cpu", "dtype": "f32", "count": 24,
//               "tensors": [{"dtype": "f32", "shape": [1, 64, 32], "strides": [2048, 1, 64], "offset": 0,
//                            "buffer": 0}, null, {"list": [{...}, ...]}, ...],
//               "attrs": {"trans_a": 1, "alpha": 1.0, "dims": [0, 1], ...},
//               "values": {"a": "c0.a", ...}}, ...]}
// One entry of "tensors" per tensor argument of the op's description, in order; null for an absent one. "buffer"
// numbers the call's distinct memories: tensors whose bytes overlap have the same number. Values are float64, row-major over the
// tensor's shape, one safetensors tensor per recorded input ("c<call>.<argument>[.<list element>]").
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>

#include <nlohmann/json.hpp>

#include "loom/common/half.h"
#include "loom/core/dispatch.h"
#include "loom/dispatch_modes.h"
#include "loom/io/atomic_file.h"
#include "loom/io/json_file.h"
#include "loom/io/read_file.h"
#include "loom/io/safetensors.h"
#include "providers/modes.h"
#include "providers/op_trace.h"
#include "providers/conformance.h"

#ifndef LOOM_VERSION_STRING
#define LOOM_VERSION_STRING "unknown"
#endif

namespace loom::op_trace {

std::string loom_version() { return LOOM_VERSION_STRING; }

namespace {

using nlohmann::json;

// A tensor's values, row-major, read with the runtime's raw copy (no kernel runs).
std::vector<double> values_of(const Tensor& t) {
  const int64_t n = t.numel();
  std::vector<double> out;
  if (n == 0) return out;
  int64_t span = 1;
  for (size_t d = 0; d < t.shape().size(); ++d) span += (t.shape()[d] - 1) * t.strides()[d];
  const size_t es = dtype_size(t.dtype());
  std::vector<uint8_t> bytes(size_t(span) * es);
  const Device dev = t.device();
  if (dev.is_cpu()) {
    std::memcpy(bytes.data(), t.data(), bytes.size());
  } else {
    device_runtime(dev.type).synchronize(dev.index);
    device_runtime(dev.type).copy(bytes.data(), t.data(), bytes.size(), CopyKind::kDeviceToHost, dev.index);
    device_runtime(dev.type).synchronize(dev.index);
  }
  out.reserve(size_t(n));
  std::vector<int64_t> idx(t.shape().size(), 0);
  for (int64_t e = 0; e < n; ++e) {
    int64_t p = 0;
    for (size_t d = 0; d < idx.size(); ++d) p += idx[d] * t.strides()[d];
    out.push_back(conformance::read_element(bytes.data() + size_t(p) * es, t.dtype()));
    for (size_t d = idx.size(); d-- > 0;) {
      if (++idx[d] < t.shape()[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

json tensor_json(const TensorMeta& t) {
  return {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"strides", t.strides}, {"offset", t.offset},
          {"buffer", t.buffer}};
}

json attr_json(const AttrValue& a) {
  switch (a.kind) {
    case AttrValue::kInt: return a.i;
    case AttrValue::kFloat: return a.f;
    case AttrValue::kInts: return a.ints;
  }
  return nullptr;
}

// The call without its count and values: what identical calls share.
json call_json(const std::string& op, Device device, DType dtype, const std::vector<SlotMeta>& slots,
               const std::vector<std::pair<std::string, AttrValue>>& attrs) {
  json tensors = json::array();
  for (const SlotMeta& s : slots) {
    if (!s.present) tensors.push_back(nullptr);
    else if (s.is_list) {
      json list = json::array();
      for (const auto& t : s.tensors) list.push_back(tensor_json(t));
      tensors.push_back({{"list", list}});
    } else {
      tensors.push_back(tensor_json(s.tensors.at(0)));
    }
  }
  json a = json::object();
  for (const auto& [name, v] : attrs) a[name] = attr_json(v);
  return {{"op", op}, {"device", device.str()}, {"dtype", dtype_name(dtype)}, {"tensors", tensors}, {"attrs", a}};
}

struct Recorded {
  json call;
  uint64_t count = 0;
  std::map<std::string, std::vector<double>> values;  // by safetensors name
  std::map<std::string, Shape> value_shapes;
};

struct Recorder {
  std::mutex mu;
  dispatch::OpTraceOptions options;
  std::map<std::string, size_t> index;  // the call's JSON -> its position
  std::vector<Recorded> calls;
  uint64_t total = 0;
};
Recorder& recorder() {
  static Recorder* r = new Recorder;
  return *r;
}

thread_local int trace_depth = 0;

void record(OpId op, Device device, DType dtype, const CallArgs& args) {
  const OpSchema& schema = op_schema(op);
  std::vector<SlotMeta> slots = slot_meta(args);
  json call = call_json(schema.name, device, dtype, slots, args.attrs);
  std::string key = call.dump();
  Recorder& r = recorder();
  std::lock_guard<std::mutex> g(r.mu);
  ++r.total;
  auto [it, fresh] = r.index.emplace(std::move(key), r.calls.size());
  if (!fresh) {
    ++r.calls[it->second].count;
    return;
  }
  Recorded rec;
  rec.call = std::move(call);
  rec.count = 1;
  if (r.options.values) {  // the read arguments' values before the kernel runs, up to the limit per tensor
    const std::string prefix = "c" + std::to_string(r.calls.size()) + ".";
    json names = json::object();
    for (size_t i = 0; i < schema.tensors.size() && i < args.slots.size(); ++i) {
      const TensorSpec& spec = schema.tensors[i];
      if (!is_input(spec.role) && spec.role != ArgRole::kInPlace) continue;
      const ArgSlot& slot = args.slots[i];
      auto keep = [&](const Tensor& t, const std::string& name) {
        if (!t.defined() || t.numel() > r.options.value_limit) return false;
        rec.values[name] = values_of(t);
        rec.value_shapes[name] = t.shape();
        return true;
      };
      if (slot.is_list) {
        json list = json::array();
        bool all = !slot.list.empty();
        for (size_t k = 0; k < slot.list.size(); ++k) {
          std::string name = prefix + spec.name + "." + std::to_string(k);
          if (keep(slot.list[k], name)) list.push_back(name);
          else all = false;
        }
        if (all) names[spec.name] = list;
      } else if (keep(slot.tensor, prefix + spec.name)) {
        names[spec.name] = prefix + spec.name;
      }
    }
    rec.call["values"] = names;
  }
  r.calls.push_back(std::move(rec));
}

}  // namespace

// ---- Reading. ----

namespace {

[[noreturn]] void bad(const std::string& path, const std::string& what) {
  LOOM_THROW("trace '", path, "': ", what);
}

// A field of an object, of the JSON type asked for: "<where>: \"<key>\" is missing" or "... must be <kind>, got <v>".
const json& field(const json& j, const char* key, const std::string& where) {
  if (!j.is_object()) throw std::runtime_error(where + " must be an object, got " + io::json_excerpt(j));
  if (!j.contains(key)) throw std::runtime_error(where + ": \"" + key + "\" is missing");
  return j[key];
}
std::string string_field(const json& j, const char* key, const std::string& where) {
  const json& v = field(j, key, where);
  if (!v.is_string()) throw std::runtime_error(where + ": \"" + key + "\" must be a string, got " + io::json_excerpt(v));
  return v.get<std::string>();
}
// An integer in [lo, hi] (JSON numbers past int64 or negative where none may be are errors, never wrapped).
int64_t int_field(const json& j, const char* key, const std::string& where, int64_t lo, int64_t hi) {
  const json& v = field(j, key, where);
  const bool in_range = v.is_number_unsigned() ? v.get<uint64_t>() <= uint64_t(hi) && (lo <= 0 || v.get<uint64_t>() >= uint64_t(lo))
                        : v.is_number_integer() && v.get<int64_t>() >= lo && v.get<int64_t>() <= hi;
  if (!in_range)
    throw std::runtime_error(where + ": \"" + key + "\" must be an integer from " + std::to_string(lo) + " to " +
                             std::to_string(hi) + ", got " + io::json_excerpt(v));
  return v.get<int64_t>();
}
Shape shape_field(const json& j, const char* key, const std::string& where) {
  const json& v = field(j, key, where);
  if (!v.is_array() || v.size() > 64) throw std::runtime_error(where + ": \"" + key + "\" must be a list of at most 64 integers, got " + io::json_excerpt(v));
  Shape out;
  for (const json& d : v) {
    if (!d.is_number_integer() || (d.is_number_unsigned() && d.get<uint64_t>() > uint64_t(INT64_MAX)) || d.get<int64_t>() < 0)
      throw std::runtime_error(where + ": \"" + key + "\" must hold integers from 0 to 2^63-1, got " + io::json_excerpt(v));
    out.push_back(d.get<int64_t>());
  }
  return out;
}

TensorMeta read_tensor(const json& j, const std::string& where) {
  if (!j.is_object()) throw std::runtime_error(where + " must be an object, got " + io::json_excerpt(j));
  TensorMeta t;
  const std::string dt = string_field(j, "dtype", where);
  try {
    t.dtype = dtype_from_name(dt);
  } catch (const Error&) {
    throw std::runtime_error(where + ": unknown dtype '" + dt + "'");
  }
  t.shape = shape_field(j, "shape", where);
  t.strides = shape_field(j, "strides", where);
  t.offset = int_field(j, "offset", where, 0, INT64_MAX);
  t.buffer = int(int_field(j, "buffer", where, 0, 1 << 20));
  if (t.strides.size() != t.shape.size())
    throw std::runtime_error(where + ": " + std::to_string(t.strides.size()) + " strides for shape " +
                             shape_str(t.shape));
  // Replay allocates what a tensor holds and what its buffer spans: refuse sizes no machine holds (a corrupt number)
  // before it tries, counting in floating point so that no product wraps (a wrapped element count replayed as empty).
  constexpr double kLimit = double(int64_t(1) << 40);
  double elements = 1, span = 1;
  for (size_t d = 0; d < t.shape.size(); ++d) {
    elements *= double(t.shape[d]);
    span += double(t.shape[d] ? t.shape[d] - 1 : 0) * double(t.strides[d]);
  }
  if (elements > kLimit || span + double(t.offset) > kLimit)
    throw std::runtime_error(where + ": shape " + shape_str(t.shape) + " strides " + shape_str(t.strides) + " offset " +
                             std::to_string(t.offset) + " spans more than 2^40 elements (a corrupt trace?)");
  return t;
}

AttrValue read_attr(const json& j, const AttrSpec& spec, const std::string& where) {
  auto is_int64 = [](const json& v) {
    return v.is_number_integer() && !(v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX));
  };
  switch (spec.kind) {
    case AttrValue::kInts: {
      bool ok = j.is_array();
      for (size_t i = 0; ok && i < j.size(); ++i) ok = is_int64(j[i]);
      if (!ok) throw std::runtime_error(where + " must be a list of 64-bit integers, got " + io::json_excerpt(j));
      return AttrValue::of_ints(j.get<std::vector<int64_t>>());
    }
    case AttrValue::kFloat:
      if (!j.is_number()) throw std::runtime_error(where + " must be a number, got " + io::json_excerpt(j));
      return AttrValue::of_float(j.get<double>());
    case AttrValue::kInt:
      if (!is_int64(j)) throw std::runtime_error(where + " must be a 64-bit integer, got " + io::json_excerpt(j));
      return AttrValue::of_int(j.get<int64_t>());
  }
  return {};
}

}  // namespace

Trace read_trace(const std::string& path) {
  Trace trace;
  trace.path = path;
  json j;
  try {
    j = io::parse_json(io::read_input_file(path, io::kMaxDataFileBytes, "trace"), "trace '" + path + "'");
  } catch (const Error& e) {
    LOOM_THROW(e.what());
  }
  if (!j.is_object() || !j.contains("format") || !j["format"].is_string())
    bad(path, "no \"format\" field: not a Loom op trace");
  if (j["format"] != kFormat) bad(path, "format '" + j["format"].get<std::string>() + "', expected '" + kFormat + "'");
  if (!j.contains("format_version") || !j["format_version"].is_number_integer())
    bad(path, "no integer \"format_version\"");
  // Compared as the JSON number it is: a version of 2^32+1 is not version 1.
  if (!(j["format_version"].is_number_unsigned() && j["format_version"].get<uint64_t>() == uint64_t(kFormatVersion)))
    bad(path, "format version " + io::json_excerpt(j["format_version"]) + "; this Loom reads version " +
                  std::to_string(kFormatVersion));
  if (!j.contains("loom_version") || !j["loom_version"].is_string()) bad(path, "no \"loom_version\"");
  trace.loom_version = j["loom_version"].get<std::string>();
  if (trace.loom_version != loom_version())
    bad(path, "recorded by Loom " + trace.loom_version + ", this is Loom " + loom_version() +
                  " (op descriptions may differ: record it again with this Loom)");
  io::SafetensorsFile values;
  if (j.contains("values") && !j["values"].is_null()) {
    try {
      trace.values_file = string_field(j["values"], "file", "\"values\"");
      trace.value_limit = int_field(j["values"], "limit", "\"values\"", 0, INT64_MAX);
    } catch (const std::exception& e) {
      bad(path, e.what());
    }
    // The values file lies beside the trace: a name from the file never reaches elsewhere ("../x", "/etc/x").
    std::filesystem::path vf(trace.values_file);
    if (vf.empty() || vf.has_parent_path() || vf.filename() == "." || vf.filename() == "..")
      bad(path, "\"values\": \"file\" must name a file beside the trace, got " + io::json_excerpt(j["values"]["file"]));
    vf = std::filesystem::path(path).parent_path() / vf;
    trace.values_file = vf.string();
    try {
      values = io::load_safetensors_file(trace.values_file);
    } catch (const std::exception& e) {
      bad(path, std::string("its values file: ") + e.what());
    }
  }
  if (!j.contains("calls") || !j["calls"].is_array()) bad(path, "no \"calls\" list");
  size_t n = 0;
  for (const json& cj : j["calls"]) {
    const std::string where = "call " + std::to_string(n++);
    CallRecord c;
    try {
      if (!cj.is_object()) throw std::runtime_error("must be an object, got " + io::json_excerpt(cj));
      c.op = string_field(cj, "op", "the call");
      const OpSchema* s = find_op_schema(c.op);
      if (!s) throw std::runtime_error("unknown op '" + c.op + "'");
      c.device = string_field(cj, "device", "the call");
      Device::parse(c.device);
      const std::string dt = string_field(cj, "dtype", "the call");
      try {
        c.dtype = dtype_from_name(dt);
      } catch (const Error&) {
        throw std::runtime_error("unknown dtype '" + dt + "'");
      }
      c.count = uint64_t(int_field(cj, "count", "the call", 1, INT64_MAX));  // -1 is no count of 2^64-1 calls
      const json& tj = field(cj, "tensors", "the call");
      if (!tj.is_array() || tj.size() != s->tensors.size())
        throw std::runtime_error("op " + c.op + " takes " + std::to_string(s->tensors.size()) +
                                 " tensor arguments, the call lists " + (tj.is_array() ? std::to_string(tj.size()) : "none"));
      std::map<int, DType> buffer_dtypes;
      for (size_t i = 0; i < tj.size(); ++i) {
        const std::string arg = "argument '" + s->tensors[i].name + "'";
        SlotMeta slot;
        if (!tj[i].is_null()) {
          slot.present = true;
          if (tj[i].is_object() && tj[i].contains("list")) {
            slot.is_list = true;
            if (!tj[i]["list"].is_array())
              throw std::runtime_error(arg + ": \"list\" must be a list, got " + io::json_excerpt(tj[i]["list"]));
            for (const json& e : tj[i]["list"]) slot.tensors.push_back(read_tensor(e, arg));
          } else {
            slot.tensors.push_back(read_tensor(tj[i], arg));
          }
          for (const TensorMeta& t : slot.tensors) {
            auto [it, fresh] = buffer_dtypes.emplace(t.buffer, t.dtype);
            if (!fresh && it->second != t.dtype)
              throw std::runtime_error(arg + " shares buffer " + std::to_string(t.buffer) +
                                       " with a tensor of another dtype");
          }
        }
        c.slots.push_back(std::move(slot));
      }
      const json& aj = field(cj, "attrs", "the call");
      if (!aj.is_object()) throw std::runtime_error("\"attrs\" is not an object");
      for (const auto& [name, v] : aj.items())
        if (!s->attr_spec(name)) throw std::runtime_error("op " + c.op + " has no attribute '" + name + "'");
      for (const AttrSpec& a : s->attrs) {
        if (!aj.contains(a.name)) throw std::runtime_error("attribute '" + a.name + "' is missing");
        c.attrs.emplace_back(a.name, read_attr(aj[a.name], a, "attribute '" + a.name + "'"));
      }
      if (std::string why = call_violation(*s, c.dtype, c.slots, c.attrs); !why.empty())
        throw std::runtime_error(why);
      c.values.resize(c.slots.size());
      if (cj.contains("values")) {
        if (trace.values_file.empty()) throw std::runtime_error("names values but the trace has no values file");
        if (!cj["values"].is_object())
          throw std::runtime_error("\"values\" must be an object, got " + io::json_excerpt(cj["values"]));
        for (const auto& [name, v] : cj["values"].items()) {
          const int i = s->tensor_index(name);
          if (i < 0 || !c.slots[size_t(i)].present) throw std::runtime_error("values for no argument '" + name + "'");
          std::vector<std::string> keys;
          bool names_ok = v.is_string() || v.is_array();
          for (size_t k = 0; names_ok && v.is_array() && k < v.size(); ++k) names_ok = v[k].is_string();
          if (!names_ok)
            throw std::runtime_error("values of '" + name + "' must be a name or a list of names, got " +
                                     io::json_excerpt(v));
          if (v.is_array()) keys = v.get<std::vector<std::string>>();
          else keys.push_back(v.get<std::string>());
          const SlotMeta& slot = c.slots[size_t(i)];
          if (keys.size() != slot.tensors.size()) throw std::runtime_error("values of '" + name + "': wrong count");
          for (size_t k = 0; k < keys.size(); ++k) {
            auto it = values.tensors.find(keys[k]);
            if (it == values.tensors.end())
              throw std::runtime_error("values '" + keys[k] + "' are not in " + trace.values_file);
            const Tensor& t = it->second;
            if (t.dtype() != kF64 || t.numel() != numel_of(slot.tensors[k].shape))
              throw std::runtime_error("values '" + keys[k] + "' in " + trace.values_file + " are " +
                                       dtype_name(t.dtype()) + shape_str(t.shape()) + ", expected f64 of " +
                                       std::to_string(numel_of(slot.tensors[k].shape)) + " elements");
            const double* p = t.data_ptr<double>();
            c.values[size_t(i)].emplace_back(p, p + t.numel());
          }
        }
      }
    } catch (const Error& e) {
      bad(path, where + ": " + e.what());
    } catch (const std::exception& e) {
      bad(path, where + ": " + e.what());
    }
    trace.calls.push_back(std::move(c));
  }
  return trace;
}

}  // namespace loom::op_trace

namespace loom::dispatch {

void set_op_tracing(bool on) {
  if (on) detail::modes.fetch_or(detail::kModeTrace);
  else detail::modes.fetch_and(~uint32_t(detail::kModeTrace));
}
bool op_tracing() { return detail::modes.load() & detail::kModeTrace; }

void set_op_trace_options(const OpTraceOptions& options) {
  auto& r = op_trace::recorder();
  std::lock_guard<std::mutex> g(r.mu);
  r.options = options;
}

void reset_op_trace() {
  auto& r = op_trace::recorder();
  std::lock_guard<std::mutex> g(r.mu);
  r.index.clear();
  r.calls.clear();
  r.total = 0;
}

OpTraceSize op_trace_size() {
  auto& r = op_trace::recorder();
  std::lock_guard<std::mutex> g(r.mu);
  return {r.calls.size(), r.total};
}

void write_op_trace(const std::string& path) {
  using nlohmann::json;
  auto& r = op_trace::recorder();
  std::lock_guard<std::mutex> g(r.mu);
  json calls = json::array();
  io::TensorMap values;
  for (const auto& rec : r.calls) {
    json c = rec.call;
    c["count"] = rec.count;
    calls.push_back(std::move(c));
    for (const auto& [name, v] : rec.values) {
      Tensor t = empty(rec.value_shapes.at(name), kF64);
      if (!v.empty()) std::memcpy(t.data(), v.data(), v.size() * sizeof(double));
      values[name] = t;
    }
  }
  json j = {{"format", op_trace::kFormat},
            {"format_version", op_trace::kFormatVersion},
            {"loom_version", op_trace::loom_version()},
            {"values", nullptr},
            {"calls", calls}};
  if (r.options.values) {
    const std::string file = path + ".values.safetensors";
    io::save_safetensors(file, values, {{"format", std::string(op_trace::kFormat) + "-values"}});
    j["values"] = {{"file", std::filesystem::path(file).filename().string()}, {"limit", r.options.value_limit}};
  }
  try {
    io::write_file_atomic(path, j.dump(1) + "\n");  // an earlier trace stays whole until this one is
  } catch (const Error& e) {
    LOOM_THROW("--trace-ops: ", e.what());
  }
}

detail::TraceScope::TraceScope(OpId op, Device device, DType dtype, const CallArgs& args) {
  if (op_trace::trace_depth++ == 0) {
    try {
      op_trace::record(op, device, dtype, args);
    } catch (...) {
      --op_trace::trace_depth;
      throw;
    }
  }
}
detail::TraceScope::~TraceScope() { --op_trace::trace_depth; }

}  // namespace loom::dispatch
