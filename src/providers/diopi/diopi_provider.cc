// Loads a DIOPI implementation library (libdiopi_impl.so: dlopen, then dlsym per function) and registers, for every
// Loom op whose DIOPI functions it exports, a kernel under the provider name (default "diopi") through the op's
// description (OpSchema::register_erased). What serves what is one table, kRows below: per Loom op, the DIOPI
// functions it needs, the calls it declines (what DIOPI cannot express), and how the op's slots and attributes
// become the functions' arguments. Nothing else here names an op.
//
// Fallback after the fact: a function that returns diopiNoImplement, diopiDtypeNotSupported or
// diopiForceFallbackToCPU hands the call to the next candidate the dispatcher would have tried (the policy's order
// after this provider), else to Loom's own kernel; it is counted (diopi_fallback_counts, and the serving kernel's
// calls in dispatch::explain), and an (op, device, dtype) answered diopiDtypeNotSupported is declined in supports()
// from then on. Any other error is a loom::Error naming the function, its code and the library's last error.
#include <dlfcn.h>

#include <diopi/functions.h>
#include <diopi/functions_ext.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>
#include <mutex>
#include <set>
#include <sstream>

#include "loom/core/dispatch.h"
#include "loom/core/op_schema.h"
#include "loom/dispatch_modes.h"
#include "loom/diopi.h"
#include "loom/providers.h"
#include "providers/diopi/diopi_handles.h"

namespace loom::providers {
namespace {

using diopi::handle;

// ---- A loaded library. ----

struct Library {
  void* handle = nullptr;
  DiopiLibrary info;
  std::vector<DeviceType> devices;
  std::map<std::string, void*> fns;  // the DIOPI functions it exports that some row uses
  const char* (*last_error)() = nullptr;
  std::mutex mu;
  std::set<std::tuple<OpId, DeviceType, DType>> dtype_refused;  // answered diopiDtypeNotSupported

  void* fn(const std::string& name) const {
    auto it = fns.find(name);
    return it == fns.end() ? nullptr : it->second;
  }
  bool refused(OpId op, DeviceType d, DType t) {
    std::lock_guard<std::mutex> g(mu);
    return dtype_refused.count({op, d, t}) > 0;
  }
};

struct State {
  std::mutex mu;
  std::vector<std::shared_ptr<Library>> libs;  // never erased: kernels hold them
  std::map<std::string, uint64_t> fallbacks;
};
State& state() {
  static State* s = new State;
  return *s;
}

// ---- A call as a row sees it. ----

struct Args {
  const OpSchema& schema;
  const CallArgs& args;
  const Library& lib;
  const Tensor& t(const char* name) const { return args.slots.at(size_t(schema.tensor_index(name))).tensor; }
  double f(const char* name, double fallback = 0) const {
    const AttrValue* v = args.attr(name);
    return v ? v->as_double() : fallback;
  }
  int64_t i(const char* name, int64_t fallback = 0) const {
    const AttrValue* v = args.attr(name);
    return v ? v->as_int() : fallback;
  }
  const std::vector<int64_t>& ints(const char* name) const {
    static const std::vector<int64_t> none;
    const AttrValue* v = args.attr(name);
    return v ? v->ints : none;
  }
  bool has(const char* fn) const { return lib.fn(fn) != nullptr; }
};

struct Call : Args {
  diopiContext& ctx;
  std::string last_fn;  // the DIOPI function called last, for the error message
  diopiGenerator gen;   // the Philox state handed to functions that take a generator

  Call(const OpSchema& s, const CallArgs& a, const Library& l, diopiContext& c) : Args{s, a, l}, ctx(c) {}

  diopiTensorHandle_t h(const Tensor& x) { return handle(ctx, x); }
  // Memory for the call (Loom's allocator, the call's device), alive until the call ends.
  Tensor scratch(const Shape& shape, DType dtype) {
    Tensor x = empty(shape, dtype, ctx.device->device());
    ctx.handles.push_back({x});
    return x;
  }
  // The output slot `name` when the call wants it, else scratch memory shaped like `like` (a DIOPI function writes
  // outputs Loom may not need); undefined when `like` is.
  Tensor output_or_scratch(const char* name, const Tensor& like) {
    if (t(name).defined() || !like.defined()) return t(name);
    return scratch(like.shape(), like.dtype());
  }
  // A one-element tensor holding `value`, on the call's device.
  Tensor constant(double value, DType dtype) {
    Tensor host = empty({}, dtype, Device());
    if (dtype == kF64) *host.data_ptr<double>() = value;
    else if (dtype == kF32) *host.data_ptr<float>() = float(value);
    else LOOM_THROW("diopi: no constant of dtype ", dtype_name(dtype));
    const Device d = ctx.device->device();
    if (d.is_cpu()) return host;
    Tensor dev = scratch({}, dtype);
    device_runtime(d.type).copy(dev.data(), host.data(), host.nbytes(), CopyKind::kHostToDevice, d.index);
    return dev;
  }
  template <typename F, typename... A>
  diopiError_t invoke(const char* name, A... a) {
    last_fn = name;
    auto* f = reinterpret_cast<F*>(lib.fn(name));
    if (!f) return diopiNoImplement;  // a row's decline() should have seen it; fall back rather than crash
    return f(&ctx, a...);
  }
};

// Calls a DIOPI function by its declaration (the header's prototype gives the type).
#define DIOPI(c, NAME, ...) (c).invoke<decltype(::NAME)>(#NAME, __VA_ARGS__)
#define DIOPI_TRY(expr)                          \
  do {                                           \
    if (diopiError_t e_ = (expr); e_ != diopiSuccess) return e_; \
  } while (0)

diopiScalar_t scalar(double v) {
  diopiScalar_t s;
  s.stype = diopi_dtype_float64;
  s.fval = v;
  return s;
}
diopiSize_t size_of(const std::vector<int64_t>& v) { return diopiSize_t{v.data(), int64_t(v.size())}; }

// A value DIOPI passes as a float: f64 calls whose value a float does not hold exactly are declined (the result
// would be off by the float's rounding, beyond f64's tolerance).
bool float_exact(double v) { return double(float(v)) == v || std::isnan(v); }
std::string floats_for(const Args& a, std::initializer_list<const char*> names, DType dtype) {
  if (dtype != kF64) return "";
  for (const char* n : names)
    if (!float_exact(a.f(n))) return std::string("DIOPI passes ") + n + " as a float, which does not hold it";
  return "";
}

// ---- The table. ----

// How the per-row losses combine, Loom's LossReduction (mean, sum, none) to DIOPI's.
diopiReduction_t reduction_of(int64_t loom) {
  return loom == 0 ? ReductionMean : loom == 1 ? ReductionSum : ReductionNone;
}

// gemm's matrices as logical, strided DIOPI tensors: Loom's slots are column-major matrices [batch, rows, cols]
// with strides [batch stride, 1, ld], i.e. already the matrices A, B, C element (i, j) at i + j ld; op(X) is a
// transposed view. C = alpha op(A) op(B) + beta C becomes mm / bmm (alpha 1, beta 0), with mulScalar for another
// alpha, addmm / baddbmm on a copy of C for beta != 0; the bias epilogue is linear on the transposed problem
// (C^T = op(B)^T op(A)^T + bias); the bias-gradient epilogue adds a sum over op(B)'s rows; the GELU epilogues add
// gelu (tanh) after the product, and the GELU-derivative one is geluBackward of the product at pre_gelu.
enum GemmEpi { kNone = 0, kBias = 1, kGelu = 2, kBiasGelu = 3, kBiasGradB = 4, kDGelu = 5 };
struct GemmView {
  Tensor a, b, c;  // op(A) [batch, m, k], op(B) [batch, k, n], C [batch, m, n]
  int64_t batch = 1;
  double alpha = 1, beta = 0;
  int epilogue = 0;
};
GemmView gemm_view(const Args& x) {
  GemmView g;
  g.a = x.i("trans_a") ? x.t("a").transpose(1, 2) : x.t("a");
  g.b = x.i("trans_b") ? x.t("b").transpose(1, 2) : x.t("b");
  g.c = x.t("c");
  g.batch = g.c.size(0);
  g.alpha = x.f("alpha", 1);
  g.beta = x.f("beta", 0);
  g.epilogue = int(x.i("epilogue"));
  return g;
}
std::string gemm_decline(const Args& x) {
  if (!x.t("a").defined() || !x.t("b").defined() || !x.t("c").defined())
    return "an empty product (no memory behind A, B or C)";
  const GemmView g = gemm_view(x);
  if (g.c.dtype() != g.a.dtype()) return "C's dtype differs from A's (DIOPI's products write their inputs' dtype)";
  const bool gelu = g.epilogue == kGelu || g.epilogue == kBiasGelu, dgelu = g.epilogue == kDGelu;
  if ((gelu && !x.has("diopiGelu")) || (dgelu && !x.has("diopiGeluBackward")))
    return "the GELU epilogue needs diopiGelu / diopiGeluBackward";
  if (gelu && g.beta != 0) return "a GELU epilogue with beta != 0";
  if (g.epilogue == kBias || g.epilogue == kBiasGelu) {
    if (g.batch != 1 || g.alpha != 1 || g.beta != 0) return "the bias epilogues map to linear: batch 1, alpha 1, beta 0";
    return x.has("diopiLinear") ? "" : "the library has no diopiLinear";
  }
  if (g.epilogue == kBiasGradB && !x.has("diopiSum")) return "the library has no diopiSum";
  if (g.beta != 0 && !x.has("diopiCopyInp")) return "beta != 0 needs diopiCopyInp";
  if (g.beta == 0 && g.alpha != 1 && !x.has("diopiMulScalar")) return "alpha != 1 needs diopiMulScalar";
  const char* need = g.batch == 1 ? (g.beta != 0 ? "diopiAddmm" : "diopiMm") : (g.beta != 0 ? "diopiBaddbmm" : "diopiBmm");
  return x.has(need) ? "" : std::string("the library has no ") + need;
}
// out = alpha op(A) op(B) + beta out (+ bias, through linear) for the views of one call.
diopiError_t gemm_product(Call& c, const GemmView& g, const Tensor& a, const Tensor& b, const Tensor& out, bool bias) {
  const bool one = g.batch == 1;
  if (bias)  // C^T [n, m] = op(B)^T [n, k] op(A)^T + bias [m]: linear(input op(B)^T, weight op(A))
    return DIOPI(c, diopiLinear, c.h(out.t()), c.h(b.t()), c.h(a), c.h(c.t("bias")));
  if (g.beta != 0) {
    Tensor old = c.scratch(out.shape(), out.dtype());  // addmm must not read C while writing it
    DIOPI_TRY(DIOPI(c, diopiCopyInp, c.h(out), c.h(old)));
    const diopiScalar_t beta = scalar(g.beta), alpha = scalar(g.alpha);
    if (one) return DIOPI(c, diopiAddmm, c.h(out), c.h(old), c.h(a), c.h(b), &beta, &alpha);
    return DIOPI(c, diopiBaddbmm, c.h(out), c.h(old), c.h(a), c.h(b), g.beta, g.alpha);
  }
  if (one) DIOPI_TRY(DIOPI(c, diopiMm, c.h(out), c.h(a), c.h(b)));
  else DIOPI_TRY(DIOPI(c, diopiBmm, c.h(out), c.h(a), c.h(b)));
  if (g.alpha == 1) return diopiSuccess;
  const diopiScalar_t alpha = scalar(g.alpha);
  return DIOPI(c, diopiMulScalar, c.h(out), c.h(out), &alpha);
}
diopiError_t gemm_run(Call& c) {
  const GemmView g = gemm_view(c);
  const bool one = g.batch == 1;
  auto first = [&](const Tensor& t) { return one && t.defined() ? t.select(0, 0) : t; };
  const Tensor a = first(g.a), b = first(g.b), out = first(g.c), pre = first(c.t("pre_gelu"));
  const bool bias = g.epilogue == kBias || g.epilogue == kBiasGelu;
  if (g.epilogue == kGelu || g.epilogue == kBiasGelu) {  // the product (+ bias) into pre_gelu (or C), then GELU
    const Tensor& target = pre.defined() ? pre : out;
    DIOPI_TRY(gemm_product(c, g, a, b, target, bias));
    return DIOPI(c, diopiGelu, c.h(out), c.h(target), "tanh");
  }
  if (g.epilogue == kDGelu) {  // C = (alpha op(A) op(B)) * gelu'(pre_gelu): GELU's backward of the product
    Tensor prod = c.scratch(out.shape(), out.dtype());
    DIOPI_TRY(gemm_product(c, g, a, b, prod, false));
    return DIOPI(c, diopiGeluBackward, c.h(out), c.h(prod), c.h(pre), "tanh");
  }
  DIOPI_TRY(gemm_product(c, g, a, b, out, bias));
  if (g.epilogue == kBiasGradB) {  // bias_grad[j] = sum over k of op(B)[k, j]
    const std::vector<int64_t> dims{0};
    DIOPI_TRY(DIOPI(c, diopiSum, c.h(c.t("bias_grad")), c.h(b), size_of(dims)));
  }
  return diopiSuccess;
}

// The norms normalize the last dim: normalized_shape = {C}.
std::vector<int64_t> last_dim(const Tensor& x) { return {x.size(x.dim() - 1)}; }

std::string attention_decline(const Args& x) {
  return floats_for(x, {"scale"}, x.t("q").dtype());
}

struct Row {
  const char* op;
  std::vector<const char*> needs;  // every one exported, or the op is not bound
  std::vector<const char*> uses;   // some calls use them: a call that needs a missing one is declined
  DTypeSet dtypes;
  std::string (*decline)(const Args&);  // why the call is not served ("": served)
  diopiError_t (*run)(Call&);
};

constexpr DTypeSet kFloats = dtypes(kF32, kF64, kF16, kBF16);
std::string serves_all(const Args&) { return ""; }

// Loom's attention tensors are [B, H, T, D]; DIOPI's flash attention takes [B, T, H, D]: the same memory, viewed.
Tensor bthd(const Tensor& t) { return t.defined() ? t.transpose(1, 2) : t; }

const std::vector<Row>& rows() {
  static const std::vector<Row> r = {
      {"gemm", {}, {"diopiMm", "diopiBmm", "diopiAddmm", "diopiBaddbmm", "diopiLinear", "diopiMulScalar", "diopiSum",
                    "diopiCopyInp", "diopiGelu", "diopiGeluBackward"},
       kFloats, gemm_decline, gemm_run},
      {"layer_norm", {"diopiLayerNorm"}, {}, kFloats, serves_all,
       [](Call& c) {
         const auto ns = last_dim(c.t("x"));
         return DIOPI(c, diopiLayerNorm, c.h(c.t("out")), c.h(c.t("mean")), c.h(c.t("rstd")), c.h(c.t("x")),
                      c.h(c.t("weight")), c.h(c.t("bias")), size_of(ns), c.f("eps"));
       }},
      {"layer_norm_backward", {"diopiLayerNormBackward"}, {}, kFloats, serves_all,
       [](Call& c) {
         const Tensor& x = c.t("x");
         const auto ns = last_dim(x);
         // DIOPI writes grad_input always, and grad_weight with a weight: give unneeded ones scratch memory.
         Tensor gi = c.output_or_scratch("grad_input", x);
         Tensor gw = c.output_or_scratch("grad_weight", c.t("weight"));
         return DIOPI(c, diopiLayerNormBackward, c.h(gi), c.h(gw), c.h(c.t("grad_bias")), c.h(c.t("grad")), c.h(x),
                      c.h(c.t("weight")), nullptr, c.h(c.t("mean")), c.h(c.t("rstd")), size_of(ns));
       }},
      {"rms_norm", {"diopiRMSNorm"}, {}, kFloats, serves_all,
       [](Call& c) {
         const auto ns = last_dim(c.t("x"));
         return DIOPI(c, diopiRMSNorm, c.h(c.t("out")), c.h(c.t("rstd")), c.h(c.t("x")), size_of(ns),
                      c.h(c.t("weight")), nullptr, c.f("eps"));
       }},
      {"rms_norm_backward", {"diopiRMSNormBackward"}, {}, kFloats, serves_all,
       [](Call& c) {
         const Tensor& x = c.t("x");
         const auto ns = last_dim(x);
         Tensor gi = c.output_or_scratch("grad_input", x);
         Tensor gw = c.output_or_scratch("grad_weight", c.t("weight"));
         // eps is not needed: the backward reads the forward's inv_rms.
         return DIOPI(c, diopiRMSNormBackward, c.h(gi), c.h(gw), nullptr, c.h(c.t("grad")), c.h(x),
                      c.h(c.t("weight")), nullptr, c.h(c.t("rstd")), size_of(ns), 0.0);
       }},
      {"softmax", {"diopiSoftmax"}, {}, kFloats, serves_all,
       [](Call& c) { return DIOPI(c, diopiSoftmax, c.h(c.t("out")), c.h(c.t("x")), c.i("dim")); }},
      {"log_softmax", {"diopiLogSoftmax"}, {}, kFloats, serves_all,
       [](Call& c) { return DIOPI(c, diopiLogSoftmax, c.h(c.t("out")), c.h(c.t("x")), c.i("dim")); }},
      {"softmax_backward", {"diopiSoftmaxBackward"}, {}, kFloats, serves_all,
       [](Call& c) {
         return DIOPI(c, diopiSoftmaxBackward, c.h(c.t("grad_input")), c.h(c.t("grad")), c.h(c.t("out")), c.i("dim"));
       }},
      {"log_softmax_backward", {"diopiLogSoftmaxBackward"}, {}, kFloats, serves_all,
       [](Call& c) {
         return DIOPI(c, diopiLogSoftmaxBackward, c.h(c.t("grad_input")), c.h(c.t("grad")), c.h(c.t("out")),
                      c.i("dim"));
       }},
      // Loom's GELU is the tanh approximation.
      {"gelu", {"diopiGelu"}, {}, kFloats, serves_all,
       [](Call& c) { return DIOPI(c, diopiGelu, c.h(c.t("out")), c.h(c.t("x")), "tanh"); }},
      {"gelu_backward", {"diopiGeluBackward"}, {}, kFloats, serves_all,
       [](Call& c) {
         return DIOPI(c, diopiGeluBackward, c.h(c.t("grad_x")), c.h(c.t("grad")), c.h(c.t("saved")), "tanh");
       }},
      {"silu", {"diopiSilu"}, {}, kFloats, serves_all,
       [](Call& c) { return DIOPI(c, diopiSilu, c.h(c.t("out")), c.h(c.t("x"))); }},
      {"silu_backward", {"diopiSiluBackward"}, {}, kFloats, serves_all,
       [](Call& c) { return DIOPI(c, diopiSiluBackward, c.h(c.t("grad_x")), c.h(c.t("grad")), c.h(c.t("saved"))); }},
      // padding_idx -1: none.
      {"embedding", {"diopiEmbedding"}, {}, kFloats, serves_all,
       [](Call& c) {
         return DIOPI(c, diopiEmbedding, c.h(c.t("out")), c.h(c.t("weight")), c.h(c.t("indices")), int64_t(-1),
                      false, false);
       }},
      {"embedding_backward", {"diopiEmbeddingBackward"}, {}, kFloats, serves_all,
       [](Call& c) {
         const Tensor& gw = c.t("grad_weight");
         return DIOPI(c, diopiEmbeddingBackward, c.h(gw), c.h(c.t("grad")), c.h(c.t("indices")), gw.size(0),
                      int64_t(-1), false, false);
       }},
      // A vocabulary limit below V: the forward reads the first columns (a view); the backwards decline (DIOPI
      // cannot zero the columns past it).
      {"cross_entropy", {"diopiCrossEntropyLoss"}, {}, kFloats, serves_all,
       [](Call& c) {
         Tensor logits = c.t("logits");
         const int64_t limit = c.i("vocab_limit", -1);
         if (limit >= 0 && limit < logits.size(1)) logits = logits.narrow(1, 0, limit);
         return DIOPI(c, diopiCrossEntropyLoss, c.h(c.t("loss")), c.h(logits), c.h(c.t("targets")), nullptr,
                      reduction_of(c.i("reduction")), c.i("ignore_index"), 0.0);
       }},
      {"cross_entropy_backward", {"diopiCrossEntropyLossBackward"}, {}, kFloats,
       [](const Args& x) -> std::string {
         const int64_t limit = x.i("vocab_limit", -1);
         return limit >= 0 && limit < x.t("logits").size(1) ? "a vocabulary limit below V" : "";
       },
       [](Call& c) {
         return DIOPI(c, diopiCrossEntropyLossBackward, c.h(c.t("grad_logits")), c.h(c.t("grad_loss")),
                      c.h(c.t("logits")), c.h(c.t("targets")), nullptr, reduction_of(c.i("reduction")),
                      c.i("ignore_index"), 0.0);
       }},
      // The loss, then its gradient for a loss gradient of 1; grad_logits may be the logits' memory, so then the
      // gradient goes to scratch memory and is copied over.
      {"cross_entropy_with_grad", {"diopiCrossEntropyLoss", "diopiCrossEntropyLossBackward"}, {"diopiCopyInp"},
       kFloats,
       [](const Args& x) -> std::string {
         const int64_t limit = x.i("vocab_limit", -1);
         if (limit >= 0 && limit < x.t("logits").size(1)) return "a vocabulary limit below V";
         if (x.t("grad_logits").shares_storage_with(x.t("logits")) && !x.has("diopiCopyInp"))
           return "a gradient written over the logits needs diopiCopyInp";
         return "";
       },
       [](Call& c) {
         const Tensor &logits = c.t("logits"), &loss = c.t("loss");
         const diopiReduction_t red = reduction_of(c.i("reduction"));
         DIOPI_TRY(DIOPI(c, diopiCrossEntropyLoss, c.h(loss), c.h(logits), c.h(c.t("targets")), nullptr, red,
                         c.i("ignore_index"), 0.0));
         Tensor one = c.constant(1.0, loss.dtype());
         const bool aliased = c.t("grad_logits").shares_storage_with(logits);
         Tensor grad = aliased ? c.scratch(logits.shape(), logits.dtype()) : c.t("grad_logits");
         DIOPI_TRY(DIOPI(c, diopiCrossEntropyLossBackward, c.h(grad), c.h(one), c.h(logits), c.h(c.t("targets")),
                         nullptr, red, c.i("ignore_index"), 0.0));
         if (aliased) DIOPI_TRY(DIOPI(c, diopiCopyInp, c.h(grad), c.h(c.t("grad_logits"))));
         return diopiSuccess;
       }},
      {"cross_entropy_scale_grad", {"diopiMul"}, {}, kFloats,
       [](const Args& x) -> std::string {
         return x.t("scale").dtype() == x.t("grad_logits").dtype() ? "" : "the scale's dtype differs from the gradient's";
       },
       [](Call& c) {
         const Tensor &g = c.t("grad_logits"), &s = c.t("scale");
         Tensor scale = s.as_strided(g.shape(), Shape(size_t(g.dim()), 0), s.storage_offset());  // broadcast
         return DIOPI(c, diopiMul, c.h(g), c.h(g), c.h(scale));
       }},
      // DIOPI's AdamW is torch.optim.AdamW's step with one dtype for the parameter, gradient and states.
      {"adamw_update", {"diopiAdamW"}, {}, kFloats,
       [](const Args& x) -> std::string {
         const DType p = x.t("param").dtype();
         if (x.t("grad").dtype() != p || x.t("exp_avg").dtype() != p || x.t("exp_avg_sq").dtype() != p)
           return "DIOPI's adamW takes the parameter's dtype for the gradient and the states";
         return floats_for(x, {"lr", "beta1", "beta2", "eps", "weight_decay"}, p);
       },
       [](Call& c) {
         return DIOPI(c, diopiAdamW, c.h(c.t("param")), c.h(c.t("grad")), c.h(c.t("exp_avg")),
                      c.h(c.t("exp_avg_sq")), nullptr, float(c.f("lr")), float(c.f("beta1")), float(c.f("beta2")),
                      float(c.f("eps")), float(c.f("weight_decay")), c.i("step"), false);
       }},
      // sum(x^2) as the squared total norm of one gradient, max_norm infinite: nothing is clipped.
      {"grad_norm_squared", {"diopiClipGradNorm"}, {}, kFloats, serves_all,
       [](Call& c) {
         double norm = 0;
         diopiTensorHandle_t grads[1] = {c.h(c.t("x"))};
         DIOPI_TRY(DIOPI(c, diopiClipGradNorm, &norm, grads, int64_t(1), std::numeric_limits<double>::infinity(),
                         2.0, false));
         const Tensor& out = c.t("out");
         Tensor v = c.constant(norm * norm, kF64);
         if (out.device().is_cpu()) *out.data_ptr<double>() = norm * norm;
         else device_runtime(out.device().type).copy(out.data(), v.data(), 8, CopyKind::kDeviceToDevice, out.device().index);
         return diopiSuccess;
       }},
      {"scaled_dot_product_attention", {"diopiFlashAttention"}, {}, kFloats, attention_decline,
       [](Call& c) {
         return DIOPI(c, diopiFlashAttention, c.h(bthd(c.t("out"))), c.h(c.t("lse")), &c.gen, c.h(bthd(c.t("q"))),
                      c.h(bthd(c.t("k"))), c.h(bthd(c.t("v"))), nullptr, 0.0f, float(c.f("scale")),
                      c.i("causal") != 0, int32_t(-1), int32_t(-1));
       }},
      {"scaled_dot_product_attention_strided", {"diopiFlashAttention"}, {}, kFloats, attention_decline,
       [](Call& c) {
         return DIOPI(c, diopiFlashAttention, c.h(bthd(c.t("out"))), c.h(c.t("lse")), &c.gen, c.h(bthd(c.t("q"))),
                      c.h(bthd(c.t("k"))), c.h(bthd(c.t("v"))), nullptr, 0.0f, float(c.f("scale")),
                      c.i("causal") != 0, int32_t(-1), int32_t(-1));
       }},
      {"scaled_dot_product_attention_backward", {"diopiFlashAttentionBackward"}, {}, kFloats, attention_decline,
       [](Call& c) {
         return DIOPI(c, diopiFlashAttentionBackward, c.h(bthd(c.t("grad_q"))), c.h(bthd(c.t("grad_k"))),
                      c.h(bthd(c.t("grad_v"))), c.h(bthd(c.t("grad_out"))), &c.gen, c.h(bthd(c.t("q"))),
                      c.h(bthd(c.t("k"))), c.h(bthd(c.t("v"))), nullptr, c.h(bthd(c.t("out"))), c.h(c.t("lse")),
                      0.0f, float(c.f("scale")), c.i("causal") != 0, int32_t(-1), int32_t(-1));
       }},
      {"scaled_dot_product_attention_backward_strided", {"diopiFlashAttentionBackward"}, {}, kFloats,
       attention_decline,
       [](Call& c) {
         return DIOPI(c, diopiFlashAttentionBackward, c.h(bthd(c.t("grad_q"))), c.h(bthd(c.t("grad_k"))),
                      c.h(bthd(c.t("grad_v"))), c.h(bthd(c.t("grad_out"))), &c.gen, c.h(bthd(c.t("q"))),
                      c.h(bthd(c.t("k"))), c.h(bthd(c.t("v"))), nullptr, c.h(bthd(c.t("out"))), c.h(c.t("lse")),
                      0.0f, float(c.f("scale")), c.i("causal") != 0, int32_t(-1), int32_t(-1));
       }},
      // rotate_half layout (interleaved false); cos and sin [T, D/2] broadcast against x [B, H, T, D/2]; the
      // inverse rotation is the conjugate.
      {"rope", {"diopiRotaryEmbedding"}, {}, kFloats, serves_all,
       [](Call& c) {
         return DIOPI(c, diopiRotaryEmbedding, c.h(c.t("out")), c.h(c.t("x")), c.h(c.t("cos")), c.h(c.t("sin")),
                      c.i("inverse") != 0, false);
       }},
      {"rope_strided", {"diopiRotaryEmbedding"}, {}, kFloats, serves_all,
       [](Call& c) {
         return DIOPI(c, diopiRotaryEmbedding, c.h(c.t("out")), c.h(c.t("x")), c.h(c.t("cos")), c.h(c.t("sin")),
                      c.i("inverse") != 0, false);
       }},
      {"add", {"diopiAdd"}, {}, kFloats, serves_all,
       [](Call& c) {
         const diopiScalar_t one = scalar(1);
         return DIOPI(c, diopiAdd, c.h(c.t("out")), c.h(c.t("a")), c.h(c.t("b")), &one);
       }},
      {"add_scaled", {"diopiAdd"}, {}, kFloats, serves_all,
       [](Call& c) {
         const diopiScalar_t alpha = scalar(c.f("alpha"));
         return DIOPI(c, diopiAdd, c.h(c.t("out")), c.h(c.t("a")), c.h(c.t("b")), &alpha);
       }},
      {"mul", {"diopiMul"}, {}, kFloats, serves_all,
       [](Call& c) { return DIOPI(c, diopiMul, c.h(c.t("out")), c.h(c.t("a")), c.h(c.t("b"))); }},
      {"add_scalar", {"diopiAddScalar"}, {}, kFloats, serves_all,
       [](Call& c) {
         const diopiScalar_t v = scalar(c.f("value")), one = scalar(1);
         return DIOPI(c, diopiAddScalar, c.h(c.t("out")), c.h(c.t("x")), &v, &one);
       }},
      {"mul_scalar", {"diopiMulScalar"}, {}, kFloats, serves_all,
       [](Call& c) {
         const diopiScalar_t v = scalar(c.f("value"));
         return DIOPI(c, diopiMulScalar, c.h(c.t("out")), c.h(c.t("x")), &v);
       }},
      {"fill", {"diopiFill"}, {}, kFloats, serves_all,
       [](Call& c) {
         const diopiScalar_t v = scalar(c.f("value"));
         return DIOPI(c, diopiFill, c.h(c.t("out")), &v);
       }},
      {"sum", {"diopiSum"}, {}, kFloats, serves_all,
       [](Call& c) { return DIOPI(c, diopiSum, c.h(c.t("out")), c.h(c.t("x")), size_of(c.ints("dims"))); }},
      {"column_sums", {"diopiSum"}, {}, kFloats, serves_all,
       [](Call& c) {
         const std::vector<int64_t> dims{0};
         return DIOPI(c, diopiSum, c.h(c.t("out")), c.h(c.t("matrix")), size_of(dims));
       }},
      // Same dtype: copyInp; a conversion: castDtype.
      {"copy", {}, {"diopiCopyInp", "diopiCastDtype"}, kFloats,
       [](const Args& x) -> std::string {
         const char* need = x.t("src").dtype() == x.t("dst").dtype() ? "diopiCopyInp" : "diopiCastDtype";
         return x.has(need) ? "" : std::string("the library has no ") + need;
       },
       [](Call& c) {
         if (c.t("src").dtype() == c.t("dst").dtype())
           return DIOPI(c, diopiCopyInp, c.h(c.t("src")), c.h(c.t("dst")));
         return DIOPI(c, diopiCastDtype, c.h(c.t("dst")), c.h(c.t("src")));
       }},
      // Loom's dropout mask is the Philox stream at (seed, offset), which its backward regenerates; DIOPI's is
      // the library's own draw. Only p = 0 (the identity) is the same op.
      {"dropout", {"diopiDropout"}, {}, kFloats,
       [](const Args& x) -> std::string {
         return x.f("p") == 0 ? "" : "DIOPI's dropout draws its own mask, not Loom's Philox stream (p > 0)";
       },
       [](Call& c) {
         c.gen.state = {uint64_t(c.i("seed")), uint64_t(c.i("offset"))};
         Tensor mask = c.scratch(c.t("x").shape(), kBool);
         return DIOPI(c, diopiDropout, c.h(c.t("out")), c.h(mask), c.h(c.t("x")), 0.0, true, &c.gen);
       }},
  };
  return r;
}

// Every DIOPI function name the table uses, and the library's informational ones.
std::vector<std::string> function_names() {
  std::set<std::string> names;
  for (const Row& r : rows()) {
    for (const char* n : r.needs) names.insert(n);
    for (const char* n : r.uses) names.insert(n);
  }
  return {names.begin(), names.end()};
}

const char* error_name(diopiError_t e) {
  switch (e) {
    case diopiSuccess: return "diopiSuccess";
    case diopiErrorOccurred: return "diopiErrorOccurred";
    case diopiNotInited: return "diopiNotInited";
    case diopi5DNotSupported: return "diopi5DNotSupported";
    case diopiNoImplement: return "diopiNoImplement";
    case diopiForceFallbackToCPU: return "diopiForceFallbackToCPU";
    case diopiDtypeNotSupported: return "diopiDtypeNotSupported";
    default: return "a DIOPI error";
  }
}

// ---- One bound op. ----

struct Binding {
  std::shared_ptr<Library> lib;
  const Row* row = nullptr;
  const OpSchema* schema = nullptr;
  DeviceType device = kCPU;
  int dispatch_slot = 0;

  DType dispatch_dtype(const CallArgs& a) const {
    const ArgSlot& s = a.slots.at(size_t(dispatch_slot));
    return s.is_list ? s.list.at(0).dtype() : s.tensor.dtype();
  }

  bool accepts(const CallArgs& a) const {
    const ArgSlot& d = a.slots.at(size_t(dispatch_slot));
    if (!d.is_list && !d.tensor.defined()) return false;  // an empty gemm (k = 0) has no A
    if (lib->refused(schema->id, device, dispatch_dtype(a))) return false;
    return row->decline(Args{*schema, a, *lib}).empty();
  }

  void run(const DeviceContext& dctx, const CallArgs& a) const {
    diopiContext ctx;
    ctx.device = &dctx;
    Call call(*schema, a, *lib, ctx);
    const diopiContext* saved = diopi::current_call;
    diopi::current_call = &ctx;
    diopiError_t e;
    try {
      e = row->run(call);
    } catch (...) {
      diopi::current_call = saved;
      throw;
    }
    diopi::current_call = saved;
    if (e == diopiSuccess) return;
    const DType dt = dispatch_dtype(a);
    if (e == diopiNoImplement || e == diopiDtypeNotSupported || e == diopiForceFallbackToCPU) {
      if (e == diopiDtypeNotSupported) {
        std::lock_guard<std::mutex> g(lib->mu);
        lib->dtype_refused.insert({schema->id, device, dt});
      }
      return fall_back(dctx, a, dt);
    }
    const char* msg = lib->last_error ? lib->last_error() : nullptr;
    LOOM_THROW("DIOPI provider '", lib->info.name, "': ", call.last_fn, " failed for op ", schema->name, " (",
               dtype_name(dt), " on ", dctx.device().str(), ") with ", error_name(e), " (", int(e), "): ",
               msg && *msg ? msg : (!ctx.error.empty() ? ctx.error : "(the library gave no message)"));
  }

  // The candidate the dispatcher would have tried after this provider, else Loom's own kernel.
  void fall_back(const DeviceContext& dctx, const CallArgs& a, DType dt) const {
    {
      State& s = state();
      std::lock_guard<std::mutex> g(s.mu);
      ++s.fallbacks[schema->name + "@" + device_type_display_name(device) + "/" + dtype_name(dt)];
    }
    const std::vector<const KernelEntry*> cands = dispatch::candidates(schema->id, device, dt);
    bool after = false;
    for (const KernelEntry* e : cands) {
      if (e->provider == lib->info.name) {
        after = true;
        continue;
      }
      if (!after) continue;
      if (!e->accepts_generic(e, a)) {
        e->declines.fetch_add(1, std::memory_order_relaxed);
        continue;
      }
      e->calls.fetch_add(1, std::memory_order_relaxed);
      return e->run_generic(e, dctx, a);
    }
    if (lib->info.name != "native" && schema->provider_accepts("native", dctx.device(), dt, a) == 1)
      return schema->run_provider("native", dctx.device(), dt, a);
    LOOM_THROW("DIOPI provider '", lib->info.name, "' could not serve op ", schema->name, " (", dtype_name(dt), " on ",
               dctx.device().str(), ") and no other kernel takes the call");
  }
};

}  // namespace

std::string load_diopi(const std::string& path, const DiopiOptions& options) {
  State& st = state();
  std::lock_guard<std::mutex> g(st.mu);
  LOOM_REQUIRE(!options.name.empty() && options.name != "native", "load_diopi: provider name '", options.name,
               "' is not allowed");
  LOOM_REQUIRE(!options.devices.empty(), "load_diopi: no device type to serve");
  for (const auto& other : st.libs)
    LOOM_REQUIRE(other->info.name != options.name, "cannot load DIOPI library '", path, "': a provider named '",
                 options.name, "' is already loaded from '", other->info.path, "'");
  for (const auto& p : providers::loaded())
    LOOM_REQUIRE(p.name != options.name, "cannot load DIOPI library '", path, "': a kernel library named '",
                 options.name, "' is already loaded from '", p.path, "'");
  for (DeviceType d : options.devices)
    LOOM_REQUIRE(has_device_runtime(d), "cannot load DIOPI library '", path, "' for ", device_type_display_name(d),
                 ": this Loom has no ", device_type_display_name(d), " runtime");

  // RTLD_NOW: a library needing a runtime function Loom does not provide fails here, not mid-training.
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* err = dlerror();
    LOOM_THROW("cannot load DIOPI library '", path, "': ", err ? err : "dlopen failed");
  }
  auto lib = std::make_shared<Library>();
  lib->handle = h;
  lib->devices = options.devices;
  lib->info.name = options.name;
  lib->info.path = path;
  for (const std::string& n : function_names())
    if (void* f = dlsym(h, n.c_str())) lib->fns[n] = f;
  if (lib->fns.empty()) {
    dlclose(h);
    LOOM_THROW("'", path, "' is not a DIOPI library: it exports none of the ", function_names().size(),
               " DIOPI functions Loom maps (diopiMm, diopiAdd, diopiSoftmax, ...)");
  }
  using StrFn = const char* (*)();
  if (auto f = reinterpret_cast<StrFn>(dlsym(h, "diopiGetVersion"))) lib->info.version = f() ? f() : "";
  if (auto f = reinterpret_cast<StrFn>(dlsym(h, "diopiGetVendorName"))) lib->info.impl_version = f() ? f() : "";
  if (auto f = reinterpret_cast<StrFn>(dlsym(h, "diopiGetImplVersion"))) {
    const char* v = f();
    if (v && *v) lib->info.impl_version += (lib->info.impl_version.empty() ? "" : " ") + std::string(v);
  }
  lib->last_error = reinterpret_cast<StrFn>(dlsym(h, "diopiGetLastErrorString"));

  for (const Row& row : rows()) {
    const OpSchema* schema = find_op_schema(row.op);
    LOOM_CHECK(schema, "DIOPI table names op '", row.op, "', which Loom does not declare");
    std::vector<std::string> missing, present;
    for (const char* n : row.needs) (lib->fn(n) ? present : missing).push_back(n);
    for (const char* n : row.uses)
      if (lib->fn(n)) present.push_back(n);
    if (!missing.empty() || present.empty()) {
      if (missing.empty())
        for (const char* n : row.uses) missing.push_back(n);
      lib->info.missing[row.op] = missing;
      continue;
    }
    lib->info.functions[row.op] = present;
    for (DeviceType d : options.devices) {
      auto b = std::make_shared<Binding>();
      b->lib = lib;
      b->row = &row;
      b->schema = schema;
      b->device = d;
      b->dispatch_slot = schema->tensor_index(schema->dispatch_tensor);
      // Below native's 0: a DIOPI kernel serves an op only where a policy routes it ("diopi:gemm" or "diopi").
      schema->register_erased(
          d, options.name, row.dtypes, -10, [b](const DeviceContext& ctx, const CallArgs& a) { b->run(ctx, a); },
          [b](const CallArgs& a) { return b->accepts(a); }, path);
      lib->info.ops.push_back(std::string(row.op) + "@" + device_type_display_name(d));
    }
  }
  st.libs.push_back(lib);
  // Verified routing keys its results by this file's content (loom/dispatch_modes.h).
  dispatch::declare_provider_library(options.name, path, "diopi " + (lib->info.version.empty() ? std::string("?")
                                                                                                 : lib->info.version));
  if (std::getenv("LOOM_PROVIDER_DEBUG"))
    std::cerr << "[loom diopi] loaded " << path << " as '" << options.name << "': " << lib->info.ops.size()
              << " ops bound\n";
  return options.name;
}

void load_diopi_from_env() {
  static std::once_flag once;
  std::call_once(once, [] {
    const char* env = std::getenv("LOOM_DIOPI_PATH");
    if (!env || !*env) return;
    DiopiOptions o;
    if (const char* devs = std::getenv("LOOM_DIOPI_DEVICES"); devs && *devs) {
      o.devices.clear();
      std::stringstream ss(devs);
      std::string d;
      while (std::getline(ss, d, ','))
        if (!d.empty()) {
          try {
            o.devices.push_back(Device::parse(d).type);
          } catch (const Error&) {
            LOOM_THROW("LOOM_DIOPI_DEVICES='", devs, "': '", d, "' is not a device type (cpu, cuda or a registered "
                       "one, comma-separated)");
          }
        }
      LOOM_REQUIRE(!o.devices.empty(), "LOOM_DIOPI_DEVICES='", devs, "' names no device type (cpu, cuda or a "
                   "registered one, comma-separated; leave it unset for the default)");
    }
    std::stringstream ss(env);
    std::string path;
    int n = 0;
    while (std::getline(ss, path, ':')) {
      if (path.empty()) continue;
      ++n;
      o.name = n == 1 ? "diopi" : "diopi" + std::to_string(n);  // diopi, diopi2, ...
      load_diopi(path, o);  // a library named in the environment that fails to load is an error
    }
  });
}

std::vector<std::string> load_diopi_libraries(const std::vector<std::string>& paths, DeviceType device) {
  std::vector<std::string> names;
  for (size_t i = 0; i < paths.size(); ++i) {
    DiopiOptions o;
    o.name = i == 0 ? "diopi" : "diopi" + std::to_string(i + 1);
    if (device != DeviceType::kCPU) o.devices.push_back(device);
    names.push_back(load_diopi(paths[i], o));
  }
  return names;
}

std::vector<DiopiLibrary> diopi_libraries() {
  State& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  std::vector<DiopiLibrary> out;
  for (const auto& l : s.libs) out.push_back(l->info);
  return out;
}

std::map<std::string, uint64_t> diopi_fallback_counts() {
  State& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  return s.fallbacks;
}

void reset_diopi_fallback_counts() {
  State& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  s.fallbacks.clear();
}

namespace {
// Libraries named in LOOM_DIOPI_PATH load before the first dispatch.
const bool diopi_env_hook = [] {
  dispatch::on_first_dispatch(&load_diopi_from_env);
  return true;
}();
}  // namespace

}  // namespace loom::providers
