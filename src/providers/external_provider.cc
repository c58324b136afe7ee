// Loads kernel libraries written against the C ABI (loom/abi/loom_kernel_abi.h) and registers, for every op they
// export, an adapter kernel that turns the call's arguments into descriptors and attributes as the op's description
// (op_schema.h) says, and calls the library. No op is named here: every declared op is reachable.
#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <iostream>
#include <mutex>
#include <set>
#include <sstream>
#include <unordered_map>

#include "loom/abi/loom_kernel_abi.h"
#include "loom/core/dispatch.h"
#include "loom/core/op_schema.h"
#include "loom/dispatch_modes.h"
#include "loom/providers.h"

namespace loom::providers {
namespace {

// ---- The host table Loom hands to every library. ----

// The context of the kernel call in progress on this thread, so get_stream returns the stream the call runs on.
thread_local const DeviceContext* current_call_context = nullptr;

void* host_get_stream(void*, int32_t device_type, int32_t device_index) {
  if (device_type < 0 || device_type >= kMaxDeviceTypes) return nullptr;
  Device d(DeviceType(device_type), device_index);
  if (current_call_context && current_call_context->device() == d) return current_call_context->stream().handle;
  if (!has_device_runtime(d.type)) return nullptr;
  return device_runtime(d.type).current_stream(device_index).handle;
}

void* host_allocate_workspace(void*, int32_t device_type, int32_t device_index, size_t bytes) {
  if (device_type < 0 || device_type >= kMaxDeviceTypes || !has_device_runtime(DeviceType(device_type)))
    return nullptr;
  try {
    return device_runtime(DeviceType(device_type)).allocate(bytes, device_index);
  } catch (const std::exception&) {
    return nullptr;  // the ABI reports out of memory as NULL; no exception crosses into C
  }
}

void host_free_workspace(void*, int32_t device_type, int32_t device_index, void* ptr) {
  if (!ptr || device_type < 0 || device_type >= kMaxDeviceTypes) return;
  try {
    device_runtime(DeviceType(device_type)).deallocate(ptr, device_index);
  } catch (const std::exception&) {
  }
}

void host_log(void* host_ctx, int32_t level, const char* message) {
  static const char* names[] = {"debug", "info", "warning", "error"};
  if (level < LOOM_LOG_INFO && !std::getenv("LOOM_PROVIDER_DEBUG")) return;
  const char* who = host_ctx ? static_cast<const char*>(host_ctx) : "provider";
  std::cerr << "[loom provider " << who << "] " << names[std::clamp(level, 0, 3)] << ": "
            << (message ? message : "") << "\n";
}

// ---- Loaded libraries. ----

struct Library {
  void* handle = nullptr;
  LoomHost host{};
  LoomProvider table{};
  std::string name;  // also host.host_ctx, for log lines
  LoadedProvider info;
  bool shut_down = false;

  std::string last_error() const {
    const char* e = table.last_error ? table.last_error(table.ctx) : nullptr;
    return e && *e ? e : "(the library gave no message)";
  }
};

struct Libraries {
  std::mutex mu;
  std::vector<std::shared_ptr<Library>> all;  // never erased: adapters hold them, libraries stay mapped
  // Libraries refused after their init ran. Their host tables must stay valid: the library may have kept the
  // pointer (a second load of an already loaded file runs the same library's init again with a new table).
  std::vector<std::shared_ptr<Library>> refused;
};
Libraries& libraries() {
  static Libraries* l = new Libraries;
  return *l;
}

// ---- Tensors and attributes as the ABI sees them. ----

LoomTensorDesc empty_desc() {
  LoomTensorDesc d;
  std::memset(&d, 0, sizeof d);
  d.struct_size = sizeof d;
  return d;
}

// What a zero-size tensor's data points at when it has no memory: data == NULL means absent in the ABI, and a present
// tensor with no elements is present. Never read or written (there is no element); aligned for any vector load check.
alignas(256) unsigned char no_elements[256];

LoomTensorDesc to_desc(const Tensor& t) {
  LoomTensorDesc d = empty_desc();
  if (!t.defined()) return d;
  LOOM_REQUIRE(t.dim() <= LOOM_MAX_DIMS, "external provider: tensor ", describe(t), " has more than ",
               LOOM_MAX_DIMS, " dims, which the kernel ABI cannot describe");
  d.dtype = int32_t(t.dtype());
  d.device_type = int32_t(t.device().type);
  d.device_index = t.device().index;
  d.rank = int32_t(t.dim());
  d.data = t.data();
  if (!d.data) {
    LOOM_CHECK(t.numel() == 0, "external provider: tensor ", describe(t), " has elements and no memory");
    d.data = no_elements;
  }
  for (int64_t i = 0; i < t.dim(); ++i) d.shape[i] = t.size(i), d.strides[i] = t.stride(i);
  return d;
}

// The call's descriptors and attributes, from its arguments and the op's description: tensors in signature order,
// inputs to `in` and outputs (in place ones too) to `out`, a list's tensors each in turn, and an argument that the
// description omits when absent left out then; attributes by name.
struct Call {
  std::vector<LoomTensorDesc> in, out;
  std::vector<LoomAttr> attrs;

  Call(const OpSchema& schema, const CallArgs& args) {
    for (size_t i = 0; i < args.slots.size(); ++i) {
      const TensorSpec& spec = schema.tensors.at(i);
      const ArgSlot& slot = args.slots[i];
      auto& side = is_input(spec.role) ? in : out;
      if (slot.is_list) {
        for (const Tensor& t : slot.list) side.push_back(to_desc(t));
      } else if (slot.tensor.defined() || !spec.omit_when_absent) {
        side.push_back(to_desc(slot.tensor));
      }
    }
    for (const auto& [name, value] : args.attrs) {  // args outlives the call: names and arrays stay valid
      LoomAttr a;
      std::memset(&a, 0, sizeof a);
      a.struct_size = sizeof a;
      a.name = name.c_str();
      a.kind = value.kind == AttrValue::kInt ? LOOM_ATTR_INT : value.kind == AttrValue::kFloat ? LOOM_ATTR_FLOAT
                                                                                             : LOOM_ATTR_INTS;
      a.i = value.i;
      a.f = value.f;
      a.ints = value.ints.data();
      a.n_ints = int64_t(value.ints.size());
      attrs.push_back(a);
    }
  }
};

// One op of one library on one device type.
struct Binding {
  std::shared_ptr<Library> lib;
  const OpSchema* schema = nullptr;
  DeviceType device = kCPU;
  LoomKernelFn fn = nullptr;
  LoomSupportsFn supports = nullptr;

  void run(const DeviceContext& ctx, const CallArgs& args) const {
    Call c(*schema, args);
    const DeviceContext* saved = current_call_context;
    current_call_context = &ctx;
    int status = fn(lib->table.ctx, c.in.data(), int(c.in.size()), c.out.data(), int(c.out.size()), c.attrs.data(),
                    int(c.attrs.size()));
    current_call_context = saved;
    if (status != LOOM_STATUS_OK)
      LOOM_THROW("provider '", lib->name, "' failed in op ", schema->name, " on ", ctx.device().str(), " (status ",
                 status, "): ", lib->last_error());
  }
  bool accepts(const CallArgs& args) const {
    Call c(*schema, args);
    return supports(lib->table.ctx, c.in.data(), int(c.in.size()), c.out.data(), int(c.out.size()),
                    c.attrs.data(), int(c.attrs.size())) != 0;
  }
};

// The dtypes of a mask that the library's ABI minor defines: the 8-bit floats from 1.3 on (a bit an older library
// sets there meant nothing to the header it was built against).
DTypeSet dtypes_from_mask(uint32_t mask, uint32_t abi_minor) {
  const int known = abi_minor >= 3 ? kNumDTypes : int(kBool) + 1;
  mask &= (1u << known) - 1;
  if (mask == 0) return DTypeSet{};
  DType first = kF32;
  for (int i = known - 1; i >= 0; --i)
    if (mask & (1u << i)) first = DType(i);
  auto pick = [&](DType t) { return (mask & (1u << unsigned(t))) ? t : first; };
  return DTypeSet{pick(kF32), pick(kF64), pick(kF16), pick(kBF16), pick(kI8), pick(kU8),
                  pick(kI32), pick(kI64), pick(kBool), pick(kF8E4M3), pick(kF8E5M2)};
}

// ---- A device registered through the library's runtime table. ----

class ExternalContext : public DeviceContext {
 public:
  ExternalContext(Device d, const LoomRuntime* rt) : DeviceContext(d), rt_(rt) {}
  Stream stream() const override {
    return Stream{device(), rt_->current_stream ? rt_->current_stream(rt_->ctx, device().index) : nullptr};
  }

 private:
  const LoomRuntime* rt_;
};

class ExternalRuntime : public DeviceRuntime {
 public:
  ExternalRuntime(DeviceType type, std::shared_ptr<Library> lib, const LoomRuntime* rt)
      : type_(type), lib_(std::move(lib)), rt_(rt) {}
  DeviceType type() const override { return type_; }
  std::string name() const override { return rt_->device_name; }
  int device_count() const override { return rt_->device_count(rt_->ctx); }
  void* allocate(size_t bytes, int index) override {
    void* p = rt_->allocate(rt_->ctx, index, bytes);
    LOOM_REQUIRE(p || bytes == 0, "device ", name(), ":", index, ": out of memory allocating ", bytes, " bytes (",
                 lib_->last_error(), ")");
    return p;
  }
  void deallocate(void* ptr, int index) override { rt_->free(rt_->ctx, index, ptr); }
  void copy(void* dst, const void* src, size_t bytes, CopyKind kind, int index) override {
    check(rt_->copy(rt_->ctx, index, dst, src, bytes, int32_t(kind)), "copy");
  }
  void synchronize(int index) override { check(rt_->synchronize(rt_->ctx, index), "synchronize"); }
  Stream current_stream(int index) override {
    return Stream{Device(type_, index), rt_->current_stream ? rt_->current_stream(rt_->ctx, index) : nullptr};
  }
  Stream create_stream(int index) override {
    if (!rt_->create_stream) return current_stream(index);
    return Stream{Device(type_, index), rt_->create_stream(rt_->ctx, index)};
  }
  void destroy_stream(Stream s) override {
    if (rt_->destroy_stream) rt_->destroy_stream(rt_->ctx, s.device.index, s.handle);
  }
  void set_current_stream(Stream s) override {
    if (rt_->set_current_stream) rt_->set_current_stream(rt_->ctx, s.device.index, s.handle);
  }
  Event create_event(int index) override {
    return Event{Device(type_, index), rt_->create_event ? rt_->create_event(rt_->ctx, index) : nullptr};
  }
  void destroy_event(Event e) override {
    if (rt_->destroy_event) rt_->destroy_event(rt_->ctx, e.device.index, e.handle);
  }
  void record_event(Event e, Stream s) override {
    if (rt_->record_event) check(rt_->record_event(rt_->ctx, e.device.index, e.handle, s.handle), "record_event");
  }
  void wait_event(Stream s, Event e) override {
    if (rt_->wait_event) check(rt_->wait_event(rt_->ctx, s.device.index, s.handle, e.handle), "wait_event");
  }
  void synchronize_event(Event e) override {
    if (rt_->synchronize_event)
      check(rt_->synchronize_event(rt_->ctx, e.device.index, e.handle), "synchronize_event");
    else synchronize(e.device.index);
  }
  const DeviceContext& context(int index) override {
    std::lock_guard<std::mutex> g(mu_);
    LOOM_REQUIRE(index >= 0 && index < device_count(), "device ", name(), ":", index, " does not exist (",
                 device_count(), " devices)");
    if (contexts_.size() <= size_t(index)) contexts_.resize(index + 1);
    if (!contexts_[index]) contexts_[index] = std::make_unique<ExternalContext>(Device(type_, index), rt_);
    return *contexts_[index];
  }

 private:
  void check(int status, const char* what) {
    LOOM_REQUIRE(status == LOOM_STATUS_OK, "device ", name(), ": ", what, " failed (status ", status, "): ",
                 lib_->last_error());
  }
  DeviceType type_;
  std::shared_ptr<Library> lib_;
  const LoomRuntime* rt_;
  std::mutex mu_;
  std::vector<std::unique_ptr<DeviceContext>> contexts_;
};

// Said once per process and library file: a library loaded again (another name, a test's reload, each app that loads
// it in one process) keeps its warnings in info.warnings without repeating them.
std::string warn(Library& lib, const std::string& msg) {
  lib.info.warnings.push_back(msg);
  static std::mutex mu;
  static std::set<std::string> said;
  std::lock_guard<std::mutex> lock(mu);
  if (said.insert(lib.info.path + '\0' + msg).second)
    std::cerr << "[loom] warning: provider '" << lib.name << "' (" << lib.info.path << "): " << msg << "\n";
  return msg;
}

}  // namespace

std::string abi_version() {
  return std::to_string(LOOM_ABI_VERSION_MAJOR) + "." + std::to_string(LOOM_ABI_VERSION_MINOR);
}

std::string load(const std::string& path, const std::string& name_override) {
  Libraries& libs = libraries();
  std::lock_guard<std::mutex> g(libs.mu);
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    const char* err = dlerror();
    LOOM_THROW("cannot load kernel library '", path, "': ", err ? err : "dlopen failed");
  }
  auto init = reinterpret_cast<LoomProviderInitFn>(dlsym(handle, LOOM_PROVIDER_INIT_SYMBOL));
  if (!init) {
    dlclose(handle);
    LOOM_THROW("'", path, "' is not a Loom kernel library: it exports no ", LOOM_PROVIDER_INIT_SYMBOL,
               " (declare it with LOOM_PROVIDER_EXPORT and extern \"C\")");
  }

  auto lib = std::make_shared<Library>();
  lib->handle = handle;
  lib->info.path = path;
  LoomHost& host = lib->host;
  host.struct_size = sizeof(LoomHost);
  host.abi_major = LOOM_ABI_VERSION_MAJOR;
  host.abi_minor = LOOM_ABI_VERSION_MINOR;
  host.get_stream = host_get_stream;
  host.allocate_workspace = host_allocate_workspace;
  host.free_workspace = host_free_workspace;
  host.log = host_log;
  host.host_ctx = nullptr;
  lib->table.struct_size = sizeof(LoomProvider);

  int status = init(&lib->host, &lib->table);
  LoomProvider& t = lib->table;
  auto refuse = [&](const std::string& why) {
    // Not dlclose'd: a library that failed init may have started threads or registered atexit handlers.
    libs.refused.push_back(lib);
    LOOM_THROW("kernel library '", path, "' refused: ", why);
  };
  if (t.abi_major != LOOM_ABI_VERSION_MAJOR)
    refuse("it was built against kernel ABI " + std::to_string(t.abi_major) + "." + std::to_string(t.abi_minor) +
           ", and this Loom implements ABI " + abi_version() +
           "; a different major version is incompatible: rebuild the library against this Loom's "
           "loom/abi/loom_kernel_abi.h");
  if (t.abi_minor > LOOM_ABI_VERSION_MINOR)
    refuse("it was built against kernel ABI " + std::to_string(t.abi_major) + "." + std::to_string(t.abi_minor) +
           ", newer than this Loom's " + abi_version() + "; use a newer Loom or build against this header");
  if (status != LOOM_STATUS_OK) {
    std::string msg = t.last_error ? lib->last_error() : "(no message)";
    refuse("loom_provider_init returned status " + std::to_string(status) + ": " + msg);
  }
  if (!t.last_error) refuse("its provider table has no last_error function");
  if (t.n_ops < 0 || (t.n_ops > 0 && !t.ops)) refuse("its op table is malformed (n_ops " + std::to_string(t.n_ops) + ")");
  lib->name = !name_override.empty() ? name_override : (t.name && *t.name ? t.name : "");
  if (lib->name.empty()) refuse("it declares no provider name (LoomProvider.name)");
  if (lib->name == "native") refuse("'native' is the name of Loom's built-in kernels");
  for (const auto& other : libs.all)
    if (other->name == lib->name && !other->shut_down)
      refuse("a provider named '" + lib->name + "' is already loaded from '" + other->info.path + "'");
  host.host_ctx = const_cast<char*>(lib->name.c_str());
  lib->info.name = lib->name;
  lib->info.version = t.version ? t.version : "";
  lib->info.abi_major = t.abi_major;
  lib->info.abi_minor = t.abi_minor;

  // A new device type first, so ops naming LOOM_DEVICE_OWN have somewhere to go.
  DeviceType own_device = kCPU;
  bool has_own_device = false;
  if (t.runtime) {
    const LoomRuntime* rt = t.runtime;
    if (!rt->device_name || !*rt->device_name || !rt->device_count || !rt->allocate || !rt->free || !rt->copy ||
        !rt->synchronize)
      refuse("its runtime table lacks a device name or one of device_count, allocate, free, copy, synchronize");
    own_device = register_device_type(rt->device_name);
    has_own_device = true;
    register_device_runtime(std::make_unique<ExternalRuntime>(own_device, lib, rt));
    lib->info.device_type = rt->device_name;
  }

  for (int i = 0; i < t.n_ops; ++i) {
    const LoomOpEntry& e = t.ops[i];
    std::string op = e.op ? e.op : "";
    if (e.struct_size < offsetof(LoomOpEntry, supports) + sizeof(LoomSupportsFn)) {
      warn(*lib, "op entry " + std::to_string(i) + " ('" + op + "') is too small; skipped");
      continue;
    }
    const OpSchema* schema = find_op_schema(op);
    if (!schema) {
      warn(*lib, "op '" + op + "' is not an op the kernel ABI " + abi_version() + " knows; skipped");
      continue;
    }
    if (schema->abi_minor > t.abi_minor) {
      warn(*lib, "op '" + op + "' came with kernel ABI " + std::to_string(LOOM_ABI_VERSION_MAJOR) + "." +
                     std::to_string(schema->abi_minor) + ", and the library was built against " +
                     std::to_string(t.abi_major) + "." + std::to_string(t.abi_minor) +
                     ", which does not define it: rebuild against this header to export it; skipped");
      continue;
    }
    if (!e.fn) {
      warn(*lib, "op '" + op + "' has no function; skipped");
      continue;
    }
    DeviceType device;
    if (e.device_type == LOOM_DEVICE_OWN) {
      if (!has_own_device) {
        warn(*lib, "op '" + op + "' names LOOM_DEVICE_OWN but the library registers no runtime; skipped");
        continue;
      }
      device = own_device;
    } else if (e.device_type >= 0 && e.device_type < kMaxDeviceTypes) {
      device = DeviceType(e.device_type);
    } else {
      warn(*lib, "op '" + op + "' names unknown device type " + std::to_string(e.device_type) + "; skipped");
      continue;
    }
    DTypeSet dts = dtypes_from_mask(e.dtypes, t.abi_minor);
    if (dts.empty()) {
      warn(*lib, "op '" + op + "' supports no dtype Loom knows (mask " + std::to_string(e.dtypes) + "); skipped");
      continue;
    }
    auto b = std::make_shared<Binding>();
    b->lib = lib;
    b->schema = schema;
    b->device = device;
    b->fn = e.fn;
    b->supports = e.supports;
    OpSchema::ErasedSupports supports;
    if (b->supports) supports = [b](const CallArgs& args) { return b->accepts(args); };
    schema->register_erased(device, lib->name, dts, e.priority,
                            [b](const DeviceContext& ctx, const CallArgs& args) { b->run(ctx, args); },
                            std::move(supports), path);
    lib->info.ops.push_back(op + "@" + device_type_display_name(device));
  }
  libs.all.push_back(lib);
  // Verified routing keys its results by this file's content and the ABI the library was built against.
  dispatch::declare_provider_library(lib->name, path, "loom-abi " + std::to_string(t.abi_major) + "." +
                                                          std::to_string(t.abi_minor));
  host_log(host.host_ctx, LOOM_LOG_DEBUG,
           ("loaded " + path + " (" + std::to_string(lib->info.ops.size()) + " ops)").c_str());
  return lib->name;
}

void unload(const std::string& name) {
  Libraries& libs = libraries();
  std::lock_guard<std::mutex> g(libs.mu);
  for (auto& lib : libs.all) {
    if (lib->name != name || lib->shut_down) continue;
    dispatch::unregister_provider(name);
    if (lib->table.shutdown) lib->table.shutdown(lib->table.ctx);
    lib->shut_down = true;
    return;
  }
  LOOM_THROW("unload: no provider named '", name, "' is loaded");
}

std::vector<LoadedProvider> loaded() {
  Libraries& libs = libraries();
  std::lock_guard<std::mutex> g(libs.mu);
  std::vector<LoadedProvider> out;
  for (const auto& lib : libs.all)
    if (!lib->shut_down) out.push_back(lib->info);
  return out;
}

void load_from_env() {
  static std::once_flag once;
  std::call_once(once, [] {
    const char* env = std::getenv("LOOM_PROVIDER_PATH");
    if (!env || !*env) return;
    std::stringstream ss(env);
    std::string path;
    while (std::getline(ss, path, ':')) {
      if (path.empty()) continue;
      load(path);  // a library named in the environment that fails to load is an error, not a silent skip
    }
  });
}

namespace {
// Libraries named in LOOM_PROVIDER_PATH load before the first dispatch.
const bool env_hook_registered = [] {
  dispatch::on_first_dispatch(&load_from_env);
  return true;
}();
}  // namespace

}  // namespace loom::providers
