// Loads kernel libraries written against the C ABI (loom/abi/loom_kernel_abi.h) and registers, for every op they
// export, an adapter kernel that turns Loom's typed arguments into descriptors and attributes and calls the library.
#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <iostream>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include "kernels/attention_kernel.h"
#include "kernels/column_sums_kernel.h"
#include "kernels/copy_kernel.h"
#include "kernels/cross_entropy_kernel.h"
#include "kernels/elementwise_kernel.h"
#include "kernels/embedding_kernel.h"
#include "kernels/gemm_kernel.h"
#include "kernels/norm_kernel.h"
#include "kernels/optimizer_kernel.h"
#include "kernels/reduce_kernel.h"
#include "kernels/rope_kernel.h"
#include "kernels/softmax_kernel.h"
#include "loom/abi/loom_kernel_abi.h"
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
  for (int64_t i = 0; i < t.dim(); ++i) d.shape[i] = t.size(i), d.strides[i] = t.stride(i);
  return d;
}

// A column-major matrix of a gemm as stored: [batch, rows, cols] with strides [batch_stride, 1, ld].
LoomTensorDesc matrix_desc(const void* data, DType dtype, const Device& dev, int64_t batch, int64_t rows,
                           int64_t cols, int64_t ld, int64_t batch_stride) {
  LoomTensorDesc d = empty_desc();
  d.dtype = int32_t(dtype);
  d.device_type = int32_t(dev.type);
  d.device_index = dev.index;
  d.rank = 3;
  d.data = const_cast<void*>(data);
  d.shape[0] = batch, d.shape[1] = rows, d.shape[2] = cols;
  d.strides[0] = batch_stride, d.strides[1] = 1, d.strides[2] = ld;
  return d;
}

struct Call {
  std::vector<LoomTensorDesc> in, out;
  std::vector<LoomAttr> attrs;

  void input(const Tensor& t) { in.push_back(to_desc(t)); }
  void output(const Tensor& t) { out.push_back(to_desc(t)); }
  LoomAttr& attr(const char* name, LoomAttrKind kind) {
    LoomAttr a;
    std::memset(&a, 0, sizeof a);
    a.struct_size = sizeof a;
    a.kind = kind;
    a.name = name;
    attrs.push_back(a);
    return attrs.back();
  }
  void attr_int(const char* name, int64_t v) { attr(name, LOOM_ATTR_INT).i = v; }
  void attr_float(const char* name, double v) { attr(name, LOOM_ATTR_FLOAT).f = v; }
  void attr_ints(const char* name, const std::vector<int64_t>& v) {  // v outlives the call
    LoomAttr& a = attr(name, LOOM_ATTR_INTS);
    a.ints = v.data();
    a.n_ints = int64_t(v.size());
  }
};

// One op of one library on one device type.
struct Binding {
  std::shared_ptr<Library> lib;
  std::string op;
  DeviceType device = kCPU;
  LoomKernelFn fn = nullptr;
  LoomSupportsFn supports = nullptr;

  void run(const DeviceContext& ctx, Call& c) const {
    const DeviceContext* saved = current_call_context;
    current_call_context = &ctx;
    int status = fn(lib->table.ctx, c.in.data(), int(c.in.size()), c.out.data(), int(c.out.size()), c.attrs.data(),
                    int(c.attrs.size()));
    current_call_context = saved;
    if (status != LOOM_STATUS_OK)
      LOOM_THROW("provider '", lib->name, "' failed in op ", op, " on ", ctx.device().str(), " (status ", status,
                 "): ", lib->last_error());
  }
  bool accepts(Call& c) const {
    return supports(lib->table.ctx, c.in.data(), int(c.in.size()), c.out.data(), int(c.out.size()),
                    c.attrs.data(), int(c.attrs.size())) != 0;
  }
};
using BindingPtr = std::shared_ptr<const Binding>;

struct Registration {
  BindingPtr binding;
  DTypeSet dtypes;
  int priority = 0;
  std::string source;
};

// Registers the adapter for op Op: `pack` moves the typed kernel arguments into a Call.
template <typename Op, typename Pack>
void bind(Op op, const Registration& r, Pack pack) {
  BindingPtr b = r.binding;
  typename Op::traits::function fn = [b, pack](const DeviceContext& ctx, auto&... args) {
    Call c;
    pack(c, args...);
    b->run(ctx, c);
  };
  typename Op::traits::supports_function supports;
  if (b->supports) {
    supports = [b, pack](auto&... args) {
      Call c;
      pack(c, args...);
      return b->accepts(c);
    };
  }
  dispatch::register_kernel_function(op, b->device, b->lib->name, r.dtypes, std::move(fn), r.priority,
                                     std::move(supports), r.source.c_str());
}

// ---- Argument packers, one per kernel signature family (the order is the one the ABI header documents). ----

// One input, one output (also column_sums, cross_entropy_scale_grad and grad_norm_squared).
const auto pack_unary = [](Call& c, const Tensor& x, Tensor& out) { c.input(x), c.output(out); };
const auto pack_unary_backward = [](Call& c, const Tensor& grad, const Tensor& saved, Tensor& grad_x) {
  c.input(grad), c.input(saved), c.output(grad_x);
};
const auto pack_binary = [](Call& c, const Tensor& a, const Tensor& b, Tensor& out) {
  c.input(a), c.input(b), c.output(out);
};
const auto pack_swiglu_backward = [](Call& c, const Tensor& grad, const Tensor& gate, const Tensor& up,
                                     Tensor& grad_gate, Tensor& grad_up) {
  c.input(grad), c.input(gate), c.input(up), c.output(grad_gate), c.output(grad_up);
};
const auto pack_add_scaled = [](Call& c, const Tensor& a, const Tensor& b, const AddScaledAttrs& at, Tensor& out) {
  c.input(a), c.input(b), c.output(out), c.attr_float("alpha", at.alpha);
};
const auto pack_scalar = [](Call& c, const Tensor& x, const ScalarAttrs& at, Tensor& out) {
  c.input(x), c.output(out), c.attr_float("value", at.value);
};
const auto pack_where = [](Call& c, const Tensor& cond, const Tensor& a, const Tensor& b, Tensor& out) {
  c.input(cond), c.input(a), c.input(b), c.output(out);
};
const auto pack_softmax = [](Call& c, const Tensor& x, const SoftmaxAttrs& at, Tensor& out) {
  c.input(x), c.output(out), c.attr_int("dim", at.dim);
};
const auto pack_softmax_backward = [](Call& c, const Tensor& grad, const Tensor& out, const SoftmaxAttrs& at,
                                      Tensor& grad_input) {
  c.input(grad), c.input(out), c.output(grad_input), c.attr_int("dim", at.dim);
};
const auto pack_layer_norm = [](Call& c, const Tensor& x, const Tensor& w, const Tensor& b, const NormAttrs& at,
                                Tensor& out, Tensor& mean, Tensor& rstd) {
  c.input(x), c.input(w), c.input(b), c.output(out), c.output(mean), c.output(rstd), c.attr_float("eps", at.eps);
};
const auto pack_layer_norm_backward = [](Call& c, const Tensor& grad, const Tensor& x, const Tensor& w,
                                         const Tensor& mean, const Tensor& rstd, Tensor& gi, Tensor& gw, Tensor& gb) {
  c.input(grad), c.input(x), c.input(w), c.input(mean), c.input(rstd);
  c.output(gi), c.output(gw), c.output(gb);
};
const auto pack_rms_norm = [](Call& c, const Tensor& x, const Tensor& w, const NormAttrs& at, Tensor& out,
                              Tensor& rstd) {
  c.input(x), c.input(w), c.output(out), c.output(rstd), c.attr_float("eps", at.eps);
};
const auto pack_rms_norm_backward = [](Call& c, const Tensor& grad, const Tensor& x, const Tensor& w,
                                       const Tensor& rstd, Tensor& gi, Tensor& gw) {
  c.input(grad), c.input(x), c.input(w), c.input(rstd), c.output(gi), c.output(gw);
};
const auto pack_residual_layer_norm = [](Call& c, const Tensor& x, const Tensor& delta, const Tensor& w,
                                         const Tensor& b, const NormAttrs& at, Tensor& residual, Tensor& out,
                                         Tensor& mean, Tensor& rstd) {
  c.input(x), c.input(delta), c.input(w), c.input(b);
  c.output(residual), c.output(out), c.output(mean), c.output(rstd), c.attr_float("eps", at.eps);
};
const auto pack_residual_layer_norm_backward = [](Call& c, const Tensor& grad_out, const Tensor& grad_residual,
                                                  const Tensor& residual, const Tensor& w, const Tensor& mean,
                                                  const Tensor& rstd, Tensor& gx, Tensor& gd, Tensor& gw,
                                                  Tensor& gb) {
  c.input(grad_out), c.input(grad_residual), c.input(residual), c.input(w), c.input(mean), c.input(rstd);
  c.output(gx), c.output(gd), c.output(gw), c.output(gb);
};
const auto pack_residual_rms_norm = [](Call& c, const Tensor& x, const Tensor& delta, const Tensor& w,
                                       const NormAttrs& at, Tensor& residual, Tensor& out, Tensor& rstd) {
  c.input(x), c.input(delta), c.input(w);
  c.output(residual), c.output(out), c.output(rstd), c.attr_float("eps", at.eps);
};
const auto pack_residual_rms_norm_backward = [](Call& c, const Tensor& grad_out, const Tensor& grad_residual,
                                                const Tensor& residual, const Tensor& w, const Tensor& rstd,
                                                Tensor& gx, Tensor& gd, Tensor& gw) {
  c.input(grad_out), c.input(grad_residual), c.input(residual), c.input(w), c.input(rstd);
  c.output(gx), c.output(gd), c.output(gw);
};
void cross_entropy_attrs(Call& c, const CrossEntropyAttrs& at) {
  c.attr_int("ignore_index", at.ignore_index);
  c.attr_int("reduction", int64_t(at.reduction));
  c.attr_int("vocab_limit", at.vocab_limit);  // -1: every column is a class
}
const auto pack_cross_entropy = [](Call& c, const Tensor& logits, const Tensor& targets,
                                   const CrossEntropyAttrs& at, Tensor& loss) {
  c.input(logits), c.input(targets), c.output(loss), cross_entropy_attrs(c, at);
};
const auto pack_cross_entropy_backward = [](Call& c, const Tensor& grad_loss, const Tensor& logits,
                                            const Tensor& targets, const CrossEntropyAttrs& at, Tensor& grad_logits) {
  c.input(grad_loss), c.input(logits), c.input(targets), c.output(grad_logits), cross_entropy_attrs(c, at);
};
const auto pack_cross_entropy_with_grad = [](Call& c, const Tensor& logits, const Tensor& targets,
                                             const CrossEntropyAttrs& at, Tensor& loss, Tensor& grad_logits) {
  c.input(logits), c.input(targets), c.output(loss), c.output(grad_logits), cross_entropy_attrs(c, at);
};
const auto pack_gemm = [](Call& c, const GemmParams& p) {
  c.in.push_back(matrix_desc(p.a, p.input_dtype, p.device, p.batch, p.trans_a ? p.k : p.m, p.trans_a ? p.m : p.k,
                             p.lda, p.stride_a));
  c.in.push_back(matrix_desc(p.b, p.input_dtype, p.device, p.batch, p.trans_b ? p.n : p.k, p.trans_b ? p.k : p.n,
                             p.ldb, p.stride_b));
  LoomTensorDesc bias = matrix_desc(p.bias, p.output_dtype, p.device, 1, p.m, 1, p.m, 0);
  bias.rank = 1, bias.shape[0] = p.m, bias.strides[0] = 1;
  c.in.push_back(bias);
  c.out.push_back(matrix_desc(p.c, p.output_dtype, p.device, p.batch, p.m, p.n, p.ldc, p.stride_c));
  c.out.push_back(matrix_desc(p.pre_gelu, p.output_dtype, p.device, p.batch, p.m, p.n, p.ldc, p.stride_c));
  if (p.epilogue == GemmEpilogue::kBiasGradB) {  // a third output only then: libraries built before it see two
    LoomTensorDesc bias_grad = matrix_desc(p.bias_grad, p.output_dtype, p.device, 1, p.n, 1, p.n, 0);
    bias_grad.rank = 1, bias_grad.shape[0] = p.n, bias_grad.strides[0] = 1;
    c.out.push_back(bias_grad);
  }
  c.attr_int("trans_a", p.trans_a), c.attr_int("trans_b", p.trans_b);
  c.attr_int("m", p.m), c.attr_int("n", p.n), c.attr_int("k", p.k);
  c.attr_int("lda", p.lda), c.attr_int("ldb", p.ldb), c.attr_int("ldc", p.ldc);
  c.attr_int("batch", p.batch);
  c.attr_int("stride_a", p.stride_a), c.attr_int("stride_b", p.stride_b), c.attr_int("stride_c", p.stride_c);
  c.attr_float("alpha", p.alpha), c.attr_float("beta", p.beta);
  c.attr_int("compute", int64_t(p.compute)), c.attr_int("epilogue", int64_t(p.epilogue));
};
const auto pack_attention = [](Call& c, const Tensor& q, const Tensor& k, const Tensor& v, const AttentionAttrs& at,
                               Tensor& out, Tensor& lse) {
  c.input(q), c.input(k), c.input(v), c.output(out), c.output(lse);
  c.attr_int("causal", at.causal), c.attr_float("scale", at.scale);
};
const auto pack_attention_backward = [](Call& c, const Tensor& grad_out, const Tensor& q, const Tensor& k,
                                        const Tensor& v, const Tensor& out, const Tensor& lse,
                                        const AttentionAttrs& at, Tensor& gq, Tensor& gk, Tensor& gv) {
  c.input(grad_out), c.input(q), c.input(k), c.input(v), c.input(out), c.input(lse);
  c.output(gq), c.output(gk), c.output(gv);
  c.attr_int("causal", at.causal), c.attr_float("scale", at.scale);
};
const auto pack_embedding = [](Call& c, const Tensor& weight, const Tensor& indices, Tensor& out) {
  c.input(weight), c.input(indices), c.output(out);
};
const auto pack_reduce = [](Call& c, const Tensor& x, const ReduceAttrs& at, Tensor& out) {
  c.input(x), c.output(out), c.attr_ints("dims", at.dims), c.attr_int("keepdim", at.keepdim);
};
const auto pack_rope = [](Call& c, const Tensor& x, const Tensor& cos, const Tensor& sin, const RopeAttrs& at,
                          Tensor& out) {
  c.input(x), c.input(cos), c.input(sin), c.output(out), c.attr_int("inverse", at.inverse);
};
const auto pack_copy = [](Call& c, const Tensor& src, Tensor& dst) { c.input(src), c.output(dst); };
const auto pack_fill = [](Call& c, const FillAttrs& at, Tensor& out) {
  c.output(out), c.attr_float("value", at.value);
};
// The updated buffers are outputs (read and written in place); grad is the one input.
const auto pack_adamw_update = [](Call& c, const AdamWAttrs& at, Tensor& param, const Tensor& grad, Tensor& exp_avg,
                                  Tensor& exp_avg_sq) {
  c.input(grad), c.output(param), c.output(exp_avg), c.output(exp_avg_sq);
  c.attr_float("lr", at.lr), c.attr_float("beta1", at.beta1), c.attr_float("beta2", at.beta2);
  c.attr_float("eps", at.eps), c.attr_float("weight_decay", at.weight_decay), c.attr_int("step", at.step);
};
const auto pack_sgd_update = [](Call& c, const SgdAttrs& at, Tensor& param, const Tensor& grad,
                                Tensor& momentum_buffer) {
  c.input(grad), c.output(param), c.output(momentum_buffer);
  c.attr_float("lr", at.lr), c.attr_float("momentum", at.momentum), c.attr_float("weight_decay", at.weight_decay);
  c.attr_int("first_step", at.first_step);
};

using Binder = void (*)(const Registration&);
#define LOOM_ABI_OP(NAME, PACK) \
  { #NAME, [](const Registration& r) { bind(NAME##_op, r, PACK); } }

// An op reachable through the ABI and the minor version that added it: a library built against an older minor
// does not get it bound (for that library the name is unknown, as it was when it was built).
struct AbiOp {
  Binder bind;
  uint32_t since_minor;
};

// Every op reachable through the ABI, by the minor version that added it. Keep in step with the list in
// loom_kernel_abi.h (its [1.1] marks).
const std::unordered_map<std::string, AbiOp>& binders() {
  static const auto* table = [] {
    auto* t = new std::unordered_map<std::string, AbiOp>;
    auto add = [t](uint32_t minor, std::initializer_list<std::pair<const char*, Binder>> ops) {
      for (const auto& [name, binder] : ops) t->emplace(name, AbiOp{binder, minor});
    };
    add(0, {
      LOOM_ABI_OP(neg, pack_unary), LOOM_ABI_OP(abs, pack_unary), LOOM_ABI_OP(exp, pack_unary),
      LOOM_ABI_OP(log, pack_unary), LOOM_ABI_OP(sqrt, pack_unary), LOOM_ABI_OP(rsqrt, pack_unary),
      LOOM_ABI_OP(tanh, pack_unary), LOOM_ABI_OP(sigmoid, pack_unary), LOOM_ABI_OP(gelu, pack_unary),
      LOOM_ABI_OP(silu, pack_unary), LOOM_ABI_OP(relu, pack_unary),
      LOOM_ABI_OP(gelu_backward, pack_unary_backward), LOOM_ABI_OP(silu_backward, pack_unary_backward),
      LOOM_ABI_OP(relu_backward, pack_unary_backward), LOOM_ABI_OP(tanh_backward, pack_unary_backward),
      LOOM_ABI_OP(sigmoid_backward, pack_unary_backward),
      LOOM_ABI_OP(add, pack_binary), LOOM_ABI_OP(sub, pack_binary), LOOM_ABI_OP(mul, pack_binary),
      LOOM_ABI_OP(div, pack_binary), LOOM_ABI_OP(maximum, pack_binary), LOOM_ABI_OP(minimum, pack_binary),
      LOOM_ABI_OP(swiglu, pack_binary), LOOM_ABI_OP(swiglu_backward, pack_swiglu_backward),
      LOOM_ABI_OP(eq, pack_binary), LOOM_ABI_OP(ne, pack_binary), LOOM_ABI_OP(lt, pack_binary),
      LOOM_ABI_OP(le, pack_binary), LOOM_ABI_OP(gt, pack_binary), LOOM_ABI_OP(ge, pack_binary),
      LOOM_ABI_OP(add_scaled, pack_add_scaled),
      LOOM_ABI_OP(add_scalar, pack_scalar), LOOM_ABI_OP(mul_scalar, pack_scalar),
      LOOM_ABI_OP(div_scalar, pack_scalar), LOOM_ABI_OP(rsub_scalar, pack_scalar),
      LOOM_ABI_OP(maximum_scalar, pack_scalar), LOOM_ABI_OP(minimum_scalar, pack_scalar),
      LOOM_ABI_OP(pow_scalar, pack_scalar),
      LOOM_ABI_OP(where, pack_where),
      LOOM_ABI_OP(softmax, pack_softmax), LOOM_ABI_OP(log_softmax, pack_softmax),
      LOOM_ABI_OP(softmax_backward, pack_softmax_backward),
      LOOM_ABI_OP(log_softmax_backward, pack_softmax_backward),
      LOOM_ABI_OP(layer_norm, pack_layer_norm), LOOM_ABI_OP(layer_norm_backward, pack_layer_norm_backward),
      LOOM_ABI_OP(rms_norm, pack_rms_norm), LOOM_ABI_OP(rms_norm_backward, pack_rms_norm_backward),
      LOOM_ABI_OP(cross_entropy, pack_cross_entropy),
      LOOM_ABI_OP(cross_entropy_backward, pack_cross_entropy_backward),
      LOOM_ABI_OP(gemm, pack_gemm),
      LOOM_ABI_OP(scaled_dot_product_attention, pack_attention),
      LOOM_ABI_OP(scaled_dot_product_attention_backward, pack_attention_backward),
      LOOM_ABI_OP(embedding, pack_embedding), LOOM_ABI_OP(embedding_backward, pack_embedding),
      LOOM_ABI_OP(sum, pack_reduce), LOOM_ABI_OP(mean, pack_reduce), LOOM_ABI_OP(max, pack_reduce),
      LOOM_ABI_OP(argmax, pack_reduce), LOOM_ABI_OP(norm, pack_reduce),
      LOOM_ABI_OP(rope, pack_rope),
      LOOM_ABI_OP(copy, pack_copy), LOOM_ABI_OP(fill, pack_fill),
    });
    add(1, {
      LOOM_ABI_OP(residual_layer_norm, pack_residual_layer_norm),
      LOOM_ABI_OP(residual_layer_norm_backward, pack_residual_layer_norm_backward),
      LOOM_ABI_OP(residual_rms_norm, pack_residual_rms_norm),
      LOOM_ABI_OP(residual_rms_norm_backward, pack_residual_rms_norm_backward),
      LOOM_ABI_OP(cross_entropy_with_grad, pack_cross_entropy_with_grad),
      LOOM_ABI_OP(cross_entropy_scale_grad, pack_unary),
      LOOM_ABI_OP(column_sums, pack_unary),
      LOOM_ABI_OP(rope_strided, pack_rope),
      LOOM_ABI_OP(scaled_dot_product_attention_strided, pack_attention),
      LOOM_ABI_OP(scaled_dot_product_attention_backward_strided, pack_attention_backward),
      LOOM_ABI_OP(adamw_update, pack_adamw_update), LOOM_ABI_OP(sgd_update, pack_sgd_update),
      LOOM_ABI_OP(grad_norm_squared, pack_unary),
    });
    return t;
  }();
  return *table;
}
#undef LOOM_ABI_OP

DTypeSet dtypes_from_mask(uint32_t mask) {
  DType first = kF32;
  for (int i = kNumDTypes - 1; i >= 0; --i)
    if (mask & (1u << i)) first = DType(i);
  auto pick = [&](DType t) { return (mask & (1u << unsigned(t))) ? t : first; };
  if ((mask & ((1u << kNumDTypes) - 1)) == 0) return DTypeSet{};
  return DTypeSet{pick(kF32), pick(kF64),  pick(kF16),  pick(kBF16), pick(kI8),
                  pick(kU8),  pick(kI32), pick(kI64), pick(kBool)};
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

std::string warn(Library& lib, const std::string& msg) {
  lib.info.warnings.push_back(msg);
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

  const auto& table = binders();
  for (int i = 0; i < t.n_ops; ++i) {
    const LoomOpEntry& e = t.ops[i];
    std::string op = e.op ? e.op : "";
    if (e.struct_size < offsetof(LoomOpEntry, supports) + sizeof(LoomSupportsFn)) {
      warn(*lib, "op entry " + std::to_string(i) + " ('" + op + "') is too small; skipped");
      continue;
    }
    auto it = table.find(op);
    if (it == table.end()) {
      warn(*lib, "op '" + op + "' is not an op the kernel ABI " + abi_version() + " knows; skipped");
      continue;
    }
    if (it->second.since_minor > t.abi_minor) {
      warn(*lib, "op '" + op + "' came with kernel ABI " + std::to_string(LOOM_ABI_VERSION_MAJOR) + "." +
                     std::to_string(it->second.since_minor) + ", and the library was built against " +
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
    DTypeSet dts = dtypes_from_mask(e.dtypes);
    if (dts.empty()) {
      warn(*lib, "op '" + op + "' supports no dtype Loom knows (mask " + std::to_string(e.dtypes) + "); skipped");
      continue;
    }
    auto b = std::make_shared<Binding>();
    b->lib = lib;
    b->op = op;
    b->device = device;
    b->fn = e.fn;
    b->supports = e.supports;
    Registration r{b, dts, e.priority, path};
    it->second.bind(r);
    lib->info.ops.push_back(op + "@" + device_type_display_name(device));
  }
  libs.all.push_back(lib);
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
