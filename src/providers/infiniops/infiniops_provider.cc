// The `infiniops` provider (see infiniops_provider.h). InfiniOps is used as it ships: its installed headers declare
// every `Operator<Op>::Call(handle, config, ...)` the library instantiates (infini/operator_call_instantiations.h,
// with the backends it was built for), so this file calls those instantiations in libinfiniops.so and needs none of
// its backend headers; cmake/InfiniOps.cmake defines LOOM_INFINIOPS_HAS_<Op> for each operator in that list.
//
// The table (kRows) has one row per Loom op: the InfiniOps operator(s), the dtypes, what is declined and why, and
// the call, written against the argument names of the op's description (op_schema.h), not slot numbers. Whether a
// row is registered on a device is InfiniOps' own answer (active_implementation_indices), not a list kept here.
#include "providers/infiniops/infiniops_provider.h"

// Swiglu (separate gate and up tensors, Loom's swiglu exactly) is marked deprecated in favour of SiluAndMul, which
// takes gate and up concatenated in one tensor; Loom's op has them apart, so Swiglu is the one that maps.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#include <infini/operator_call_instantiations.h>

#include <link.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <set>

#include "kernels/copy_kernel.h"
#include "kernels/elementwise_kernel.h"
#include "kernels/embedding_kernel.h"
#include "kernels/gemm_kernel.h"
#include "kernels/norm_kernel.h"
#include "kernels/rope_kernel.h"
#include "kernels/softmax_kernel.h"
#include "loom/common/error.h"
#include "loom/core/device_runtime.h"
#include "loom/core/op_schema.h"
#include "loom/dispatch_modes.h"

namespace loom::providers::infiniops {

#if defined(LOOM_INFINIOPS_NVIDIA) && defined(LOOM_WITH_CUDA)
// rstd = 1 / sqrt(mean(x^2) + eps) per row of a [R, C] view with unit inner stride, in f64 (infiniops_rstd.cu).
void row_rstd_cuda(const Tensor& x, double eps, Tensor& rstd, void* stream);
#endif

namespace {

namespace io = infini::ops;

std::atomic<Fault> g_fault{Fault::kNone};

std::optional<io::DataType> infini_dtype(DType t) {
  switch (t) {
    case kF32: return io::DataType::kFloat32;
    case kF64: return io::DataType::kFloat64;
    case kF16: return io::DataType::kFloat16;
    case kBF16: return io::DataType::kBFloat16;
    case kI8: return io::DataType::kInt8;
    case kU8: return io::DataType::kUInt8;
    case kI32: return io::DataType::kInt32;
    case kI64: return io::DataType::kInt64;
    default: return std::nullopt;  // bool: InfiniOps has no boolean dtype
  }
}

std::optional<io::Device::Type> infini_device(DeviceType t) {
  if (t == kCPU) return io::Device::Type::kCpu;
#if defined(LOOM_INFINIOPS_NVIDIA) && defined(LOOM_WITH_CUDA)
  if (t == kCUDA) return io::Device::Type::kNvidia;
#endif
  return std::nullopt;
}

// A Loom tensor as an InfiniOps tensor view: the same memory (data() includes the storage offset), with the given
// shape and strides in elements (default: the tensor's own).
io::Tensor view(const Tensor& t, const Shape& shape, const Shape& strides) {
  io::Tensor::Shape s(shape.begin(), shape.end());
  io::Tensor::Strides st(strides.begin(), strides.end());
  const Device d = t.device();
  return io::Tensor{t.data(), s, *infini_dtype(t.dtype()), io::Device{*infini_device(d.type), d.index}, st};
}
io::Tensor view(const Tensor& t) { return view(t, t.shape(), t.strides()); }
// A row op's [R, C] view of a tensor contiguous in its rows (the norms' x and out).
io::Tensor rows_view(const Tensor& t) {
  const int64_t c = t.size(-1);
  return view(t, {t.numel() / c, c}, {c, 1});
}

// One call of a row: the description gives the argument names.
struct Call {
  const OpSchema& schema;
  const CallArgs& args;
  const DeviceContext* ctx = nullptr;  // null in supports()

  const Tensor& t(const char* name) const {
    const int i = schema.tensor_index(name);
    LOOM_CHECK(i >= 0, "infiniops: op ", schema.name, " has no argument '", name, "'");
    return args.slots.at(size_t(i)).tensor;
  }
  double attr(const char* name, double fallback = 0) const {
    const AttrValue* v = args.attr(name);
    return v ? v->as_double() : fallback;
  }
  io::Device::Type device() const {
    for (const auto& s : args.slots)
      if (s.tensor.defined()) return *infini_device(s.tensor.device().type);
    return io::Device::Type::kCpu;
  }
  // The handle of the call: Loom's stream for it; InfiniOps' operators used here ask for no workspace
  // (workspace_size_in_bytes() is 0), and the scratch memory a row needs comes from Loom's allocator (Scratch).
  io::Handle handle() const {
    io::Handle h;
    h.set_stream(ctx->stream().handle);
    return h;
  }
};

// Scratch memory from Loom's allocator for the call's device, freed when the call returns (stream-ordered on CUDA,
// like every temporary of Loom's own kernels).
Tensor scratch(const Tensor& like, const Shape& shape) { return empty(shape, like.dtype(), like.device()); }

// Whether libinfiniops has an implementation of Op on the device, by its own instantiation of
// active_implementation_indices. Called through a volatile pointer: the header's inline body, if inlined here,
// would answer from this unit, which includes no backend implementation headers (and so says "none").
template <typename Op>
bool has_impl(io::Device::Type d) {
  static std::vector<std::size_t> (*volatile const fn)(io::Device::Type) =
      &io::Operator<Op>::active_implementation_indices;
  return !fn(d).empty();
}

// ---- Checks shared by rows (each returns the reason to decline, or nullptr). ----
const char* same_dtypes(std::initializer_list<const Tensor*> ts) {
  DType d = (*ts.begin())->dtype();
  for (const Tensor* t : ts)
    if (t->defined() && t->dtype() != d) return "mixed dtypes";
  return nullptr;
}
const char* mappable(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts) {
    if (!t->defined()) continue;
    if (!infini_dtype(t->dtype())) return "a dtype InfiniOps lacks (bool)";
    for (int64_t s : t->strides())
      if (s < 0) return "a negative stride";
  }
  return nullptr;
}
bool unit_rows(const Tensor& t) { return t.is_contiguous(); }

// Writes rstd [R] (f32, or f64 for f64) of x's rows in f64: InfiniOps' RmsNorm returns only its output, and Loom's
// contract has the backward read rstd. One more read of x, in the adapter.
void write_rstd(const Call& c, const Tensor& x, double eps, Tensor& rstd) {
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  const Tensor x2 = x.view({rows, cols});
  if (x.device().type == kCPU) {
    auto row_sum = [&](int64_t r) {
      double ss = 0;
      const char* p = static_cast<const char*>(x2.data()) + size_t(r * cols) * x2.itemsize();
      for (int64_t j = 0; j < cols; ++j) {
        double v = 0;
        switch (x2.dtype()) {
          case kF32: v = reinterpret_cast<const float*>(p)[j]; break;
          case kF64: v = reinterpret_cast<const double*>(p)[j]; break;
          case kBF16: v = float(reinterpret_cast<const BFloat16*>(p)[j]); break;
          case kF16: v = float(reinterpret_cast<const Half*>(p)[j]); break;
          default: LOOM_THROW("infiniops: rstd of a ", dtype_name(x2.dtype()), " tensor");
        }
        ss += v * v;
      }
      return 1.0 / std::sqrt(ss / double(cols) + eps);
    };
#pragma omp parallel for if (rows * cols > (1 << 16))
    for (int64_t r = 0; r < rows; ++r) {
      const double v = row_sum(r);
      if (rstd.dtype() == kF64) static_cast<double*>(rstd.data())[r] = v;
      else static_cast<float*>(rstd.data())[r] = float(v);
    }
    return;
  }
#if defined(LOOM_INFINIOPS_NVIDIA) && defined(LOOM_WITH_CUDA)
  Tensor r1 = rstd;
  row_rstd_cuda(x2, eps, r1, c.ctx->stream().handle);
#else
  (void)c;
  LOOM_THROW("infiniops: rstd on ", device_type_display_name(x.device().type), " is not built");
#endif
}

// ---- The table. ----
struct Row {
  const char* op;        // the Loom op
  const char* infini;    // the InfiniOps operator(s) it calls
  DTypeSet dtypes;       // the dispatch dtypes registered
  const char* declines;  // what it declines, for docs and rows()
  bool (*available)(io::Device::Type);
  const char* (*decline)(const Call&);  // the reason to decline, or nullptr: InfiniOps does this call exactly
  void (*run)(const Call&);
};

// gemm: Loom's C (column-major, [batch, m, n] with strides [stride_c, 1, ldc]) is InfiniOps' y, and op(A), op(B) are
// passed as strided views of the stored matrices, so no transpose flag is needed. InfiniOps' Gemm has no beta
// (EffectiveBeta is 0): beta != 0 runs the product into scratch memory, then Add(product, C, alpha = beta) into C.
io::Tensor gemm_operand(const Tensor& m, bool trans) {
  // m is stored [batch, rows, cols] with strides [bs, 1, ld]; op(m) swaps the two inner dims when trans.
  const Shape& s = m.shape();
  const Shape& st = m.strides();
  return trans ? view(m, {s[0], s[2], s[1]}, {st[0], st[2], st[1]}) : view(m, s, st);
}
const char* gemm_decline(const Call& c) {
  const Tensor &a = c.t("a"), &b = c.t("b"), &out = c.t("c");
  if (!a.defined() || !b.defined() || !out.defined()) return "an absent matrix";
  // Without an epilogue Loom's gemm neither reads bias nor writes pre_gelu or bias_grad, whether given or not.
  if (c.attr("epilogue") != 0) return "an epilogue (InfiniOps' Gemm has none)";
  if (a.dtype() != out.dtype() || b.dtype() != a.dtype()) return "an output dtype other than the inputs'";
  if (a.dtype() == kF64) return "f64 (InfiniOps accumulates in f32)";
  if (const char* r = mappable({&a, &b, &out})) return r;
  if (c.device() != io::Device::Type::kCpu) {
    // cuBLAS with CUBLAS_COMPUTE_32F_FAST_TF32 for f32: only where Loom allows TF32.
    if (a.dtype() == kF32 && ComputeType(int(c.attr("compute"))) != ComputeType::kTF32)
      return "f32 without TF32 allowed (InfiniOps' NVIDIA gemm computes f32 in TF32)";
    // A product with one row (m = 1) or a sum of one term (k = 1) leaves C unwritten (NaN) in 16-bit on the H100
    // (conformance, 2026-11-26): an operand with a dim of 1 has two unit strides, which its layout inference misreads.
    const bool ta = c.attr("trans_a") != 0;
    if ((ta ? a.size(2) : a.size(1)) == 1 || (ta ? a.size(1) : a.size(2)) == 1) return "m = 1 or k = 1";
  }
  if (c.attr("beta") != 0 && !has_impl<io::Add>(c.device())) return "beta != 0 (no InfiniOps Add on the device)";
  return nullptr;
}
void gemm_run(const Call& c) {
  const Tensor &a = c.t("a"), &b = c.t("b"), &out = c.t("c");
  Tensor a_view = a;
  if (g_fault.load() == Fault::kGemmZeroABatchStride)  // every problem of the batch reads A's first matrix
    a_view = a.as_strided(a.shape(), {0, a.stride(1), a.stride(2)}, a.storage_offset());
  const io::Tensor A = gemm_operand(a_view, c.attr("trans_a") != 0);
  const io::Tensor B = gemm_operand(b, c.attr("trans_b") != 0);
  const double beta = c.attr("beta");
  const std::optional<float> alpha = float(c.attr("alpha", 1));
  const io::Handle h = c.handle();
  const io::Config cfg;
  const std::optional<io::Tensor> no_c;
  const std::optional<float> no_beta;
  const std::optional<int> no_trans{0};
  if (beta == 0) {
    io::Operator<io::Gemm>::Call(h, cfg, A, B, no_c, alpha, no_beta, no_trans, no_trans, view(out));
    return;
  }
  Tensor prod = scratch(out, out.shape());  // contiguous [batch, m, n]
  io::Operator<io::Gemm>::Call(h, cfg, A, B, no_c, alpha, no_beta, no_trans, no_trans,
                                view(prod, out.shape(), {out.size(1) * out.size(2), 1, out.size(1)}));
  const io::Tensor C = view(out);
  io::Operator<io::Add>::Call(h, cfg, view(prod, out.shape(), {out.size(1) * out.size(2), 1, out.size(1)}), C, beta,
                              C);
}

// Elementwise rows: InfiniOps' elementwise operators take any strides, broadcast (stride 0) inputs included, and
// compute 16-bit types in f32 like Loom's.
// InfiniOps' CPU elementwise kernels fail Loom's f16 cases (nearly every one; bf16 and f32 pass): declined there.
const char* cpu_f16(const Call& c, const Tensor& out) {
  return c.device() == io::Device::Type::kCpu && out.dtype() == kF16 ? "f16 on the CPU (fails conformance)" : nullptr;
}
const char* binary_decline(const Call& c) {
  const Tensor &a = c.t("a"), &b = c.t("b"), &out = c.t("out");
  if (const char* r = cpu_f16(c, out)) return r;
  if (const char* r = same_dtypes({&a, &b, &out})) return r;
  return mappable({&a, &b, &out});
}
template <typename Op>
void binary_run(const Call& c) {
  io::Operator<Op>::Call(c.handle(), io::Config{}, view(c.t("a")), view(c.t("b")), view(c.t("out")));
}
const char* unary_decline(const Call& c) {
  const Tensor &x = c.t("x"), &out = c.t("out");
  if (const char* r = cpu_f16(c, out)) return r;
  if (const char* r = same_dtypes({&x, &out})) return r;
  return mappable({&x, &out});
}

// rms_norm: RmsNorm over the [R, C] rows (its weight is required: an absent one is declined), rstd by the adapter.
const char* rms_norm_decline(const Call& c) {
  const Tensor &x = c.t("x"), &w = c.t("weight"), &out = c.t("out");
  if (!w.defined()) return "no weight (InfiniOps' RmsNorm requires one)";
  if (const char* r = same_dtypes({&x, &w, &out})) return r;
  if (x.dtype() == kF64) return "f64 (InfiniOps accumulates in f32)";
  if (!unit_rows(x) || !unit_rows(out) || !w.is_contiguous()) return "a non-contiguous row tensor";
  return mappable({&x, &w, &out});
}
void rms_norm_run(const Call& c) {
  const Tensor &x = c.t("x"), &out = c.t("out");
  Tensor rstd = c.t("rstd");
  const double eps = c.attr("eps", 1e-5);
  io::Operator<io::RmsNorm>::Call(c.handle(), io::Config{}, rows_view(x), view(c.t("weight")), float(eps),
                                  rows_view(out));
  write_rstd(c, x, eps, rstd);
}

// residual_rms_norm: residual = Add(x, delta) in x's dtype, then RmsNorm of that rounded residual, which is Loom's
// contract exactly (InfiniOps' AddRmsNorm is not used: it is NVIDIA-only and normalizes the unrounded f32 sum).
// Without delta it is rms_norm of x. The autocast form (bf16 delta/out beside an f32 x) is declined.
const char* residual_rms_norm_decline(const Call& c) {
  const Tensor &x = c.t("x"), &d = c.t("delta"), &w = c.t("weight"), &res = c.t("residual"), &out = c.t("out");
  if (!w.defined()) return "no weight (InfiniOps' RmsNorm requires one)";
  if (same_dtypes({&x, &d, &w, &res, &out})) return "16-bit delta/out beside the residual (autocast's form)";
  if (x.dtype() == kF64) return "f64 (InfiniOps accumulates in f32)";
  if (!unit_rows(x) || !unit_rows(out) || (d.defined() && !unit_rows(d)) || (res.defined() && !unit_rows(res)))
    return "a non-contiguous row tensor";
  if (d.defined() && !has_impl<io::Add>(c.device())) return "no InfiniOps Add on the device";
  return mappable({&x, &d, &w, &res, &out});
}
void residual_rms_norm_run(const Call& c) {
  const Tensor &x = c.t("x"), &d = c.t("delta"), &res = c.t("residual"), &out = c.t("out");
  Tensor rstd = c.t("rstd");
  const double eps = c.attr("eps", 1e-5);
  const io::Handle h = c.handle();
  Tensor normed = x;
  if (d.defined()) {
    // The residual output is required with delta (present_with); scratch if a caller left it out.
    normed = res.defined() ? res : scratch(x, x.shape());
    io::Operator<io::Add>::Call(h, io::Config{}, rows_view(x), rows_view(d), rows_view(normed));
  }
  io::Operator<io::RmsNorm>::Call(h, io::Config{}, rows_view(normed), view(c.t("weight")), float(eps),
                                  rows_view(out));
  write_rstd(c, normed, eps, rstd);
}

// copy: Cast converts any pair of InfiniOps dtypes over any strides; same-dtype copies use Copy where the device has
// it and Cast does not (NVIDIA).
const char* copy_decline(const Call& c) {
  const Tensor &src = c.t("src"), &dst = c.t("dst");
  if (const char* r = mappable({&src, &dst})) return r;
  if (const char* r = cpu_f16(c, src.dtype() == kF16 ? src : dst)) return r;
  if (has_impl<io::Cast>(c.device())) return nullptr;
#ifdef LOOM_INFINIOPS_HAS_Copy
  if (src.dtype() == dst.dtype() && has_impl<io::Copy>(c.device())) return nullptr;
#endif
  return "a dtype conversion (no InfiniOps Cast on the device)";
}
void copy_run(const Call& c) {
  const Tensor &src = c.t("src"), &dst = c.t("dst");
  if (has_impl<io::Cast>(c.device())) {
    io::Operator<io::Cast>::Call(c.handle(), io::Config{}, view(src), view(dst));
    return;
  }
#ifdef LOOM_INFINIOPS_HAS_Copy
  io::Operator<io::Copy>::Call(c.handle(), io::Config{}, view(src), false, view(dst));
#endif
}

#if defined(LOOM_INFINIOPS_HAS_RotaryEmbedding) && defined(LOOM_INFINIOPS_HAS_Copy)
// rope, rope_strided: RotaryEmbedding with is_neox (element i pairs with i + D/2, Loom's rotate-half layout), math in
// f32, sin negated when inverse, cos and sin read from one cache row [cos | sin] per position: Loom's formula
// exactly. It rotates a query [tokens, heads, D] in place, with its own token and head strides (unit inner stride),
// and steps from token to token by that one stride, so a [B, H, T, D] tensor goes in one call per batch. The adapter
// copies x into out and cos, sin into the cache [T, D] (f32, as Loom's tables are) with InfiniOps' Copy: a
// provider's kernel calls no Loom op, which the policy may route nowhere (conformance allows the provider alone).

// Positions 0..n-1 (int64) on a device, made once and grown on demand: RotaryEmbedding reads each token's position
// from memory. Written from the host on the device's stream, then waited for (the host buffer goes), so only a first
// use and a longer T wait. Never freed: freeing device memory after the CUDA runtime's teardown crashes at exit.
Tensor positions_on(Device dev, int64_t n) {
  static std::mutex mu;
  static auto* buffers = new std::map<std::pair<int, int>, Tensor>();
  std::lock_guard<std::mutex> g(mu);
  Tensor& buf = (*buffers)[{int(dev.type), dev.index}];
  if (!buf.defined() || buf.numel() < n) {
    std::vector<int64_t> host(size_t(std::max<int64_t>(n, 4096)));
    std::iota(host.begin(), host.end(), int64_t(0));
    Tensor fresh = empty({int64_t(host.size())}, kI64, dev);
    DeviceRuntime& rt = device_runtime(dev.type);
    rt.copy(fresh.data(), host.data(), host.size() * sizeof(int64_t), CopyKind::kHostToDevice, dev.index);
    rt.synchronize(dev.index);
    buf = fresh;
  }
  return buf.as_strided({n}, {1}, 0);
}

bool rope_available(io::Device::Type d) { return has_impl<io::RotaryEmbedding>(d) && has_impl<io::Copy>(d); }
const char* rope_decline(const Call& c) {
  const Tensor &x = c.t("x"), &cs = c.t("cos"), &sn = c.t("sin"), &out = c.t("out");
  if (const char* r = same_dtypes({&x, &out})) return r;
  if (x.dtype() != kF32 && x.dtype() != kBF16 && x.dtype() != kF16)
    return "a dtype other than f32, bf16, f16 (RotaryEmbedding computes in f32)";
  if (cs.dtype() != kF32 || sn.dtype() != kF32) return "cos/sin not f32";
  if (x.dim() != 4 || x.shape() != out.shape()) return "x/out not of one [B, H, T, D] shape";
  const int64_t T = x.size(2), D = x.size(3);
  if (D % 2) return "an odd D";
  if (cs.shape() != Shape{T, D / 2} || sn.shape() != Shape{T, D / 2}) return "cos/sin not [T, D/2]";
  if (!cs.is_contiguous() || !sn.is_contiguous()) return "non-contiguous cos/sin";
  if (x.numel() && (x.stride(3) != 1 || out.stride(3) != 1)) return "a non-unit stride along D";
  return mappable({&x, &cs, &sn, &out});
}
void rope_run(const Call& c) {
  const Tensor &x = c.t("x"), &cs = c.t("cos"), &sn = c.t("sin"), &out = c.t("out");
  if (out.numel() == 0) return;
  const int64_t B = out.size(0), H = out.size(1), T = out.size(2), D = out.size(3), half = D / 2;
  const io::Handle h = c.handle();
  // In place on out: x goes in first, unless out is x itself (same elements, same layout).
  if (!(x.data() == out.data() && x.strides() == out.strides()))
    io::Operator<io::Copy>::Call(h, io::Config{}, view(x), false, view(out));
  Tensor cache = scratch(cs, {T, D});
  io::Operator<io::Copy>::Call(h, io::Config{}, view(cs), false, view(cache, {T, half}, {D, 1}));
  io::Operator<io::Copy>::Call(h, io::Config{}, view(sn), false, view(cache.as_strided({T, half}, {D, 1}, half)));
  const io::Tensor pos = view(positions_on(out.device(), T)), cos_sin = view(cache);
  const bool inverse = c.attr("inverse") != 0;
  for (int64_t b = 0; b < B; ++b) {
    const Tensor q =
        out.as_strided({T, H, D}, {out.stride(2), out.stride(1), 1}, out.storage_offset() + b * out.stride(0));
    io::Operator<io::RotaryEmbedding>::Call(h, io::Config{}, pos, view(q), std::optional<io::Tensor>{}, cos_sin,
                                            int64_t(D), true, int64_t(0), inverse);
  }
}
#endif

const DTypeSet kFloats = dtypes(kF32, kBF16, kF16);
const DTypeSet kFloats64 = dtypes(kF32, kF64, kBF16, kF16);

const Row kRows[] = {
    {"gemm", "Gemm (+ Add for beta != 0)", kFloats,
     "epilogues (bias, GELU, bias gradient); an output dtype other than the inputs'; f64 (f32 accumulation); on "
     "NVIDIA f32 unless TF32 is allowed (cuBLAS TF32)",
     has_impl<io::Gemm>, gemm_decline, gemm_run},
    {"add", "Add", kFloats64, "f16 on the CPU", has_impl<io::Add>, binary_decline, binary_run<io::Add>},
    {"mul", "Mul", kFloats64, "f16 on the CPU", has_impl<io::Mul>, binary_decline, binary_run<io::Mul>},
    {"silu", "Silu", kFloats64, "f16 on the CPU", has_impl<io::Silu>, unary_decline,
     [](const Call& c) { io::Operator<io::Silu>::Call(c.handle(), io::Config{}, view(c.t("x")), view(c.t("out"))); }},
    {"swiglu", "Swiglu (input = up, gate = gate)", kFloats64, "f16 on the CPU", has_impl<io::Swiglu>,
     [](const Call& c) -> const char* {
       const Tensor &g = c.t("gate"), &u = c.t("up"), &out = c.t("out");
       if (const char* r = cpu_f16(c, out)) return r;
       // Its NVIDIA kernel computes the sigmoid of f64 in f32 (6e-8 off; conformance on the H100, 2026-11-26).
       if (c.device() != io::Device::Type::kCpu && out.dtype() == kF64) return "f64 on NVIDIA (f32 sigmoid)";
       if (const char* r = same_dtypes({&g, &u, &out})) return r;
       return mappable({&g, &u, &out});
     },
     [](const Call& c) {
       io::Operator<io::Swiglu>::Call(c.handle(), io::Config{}, view(c.t("up")), view(c.t("gate")), view(c.t("out")));
     }},
    {"rms_norm", "RmsNorm (rstd by the adapter, in f64)", kFloats,
     "no weight; f64 (f32 accumulation); non-contiguous rows", has_impl<io::RmsNorm>, rms_norm_decline,
     rms_norm_run},
    {"residual_rms_norm", "Add + RmsNorm (rstd by the adapter)", kFloats,
     "no weight; autocast's 16-bit delta/out beside an f32 residual; f64", has_impl<io::RmsNorm>,
     residual_rms_norm_decline, residual_rms_norm_run},
    {"copy", "Cast (Copy on NVIDIA)", dtypes(kF32, kF64, kBF16, kF16, kI8, kU8, kI32, kI64),
     "bool; f16 on the CPU; on NVIDIA a dtype conversion (no Cast there)",
     [](io::Device::Type d) {
       bool copy = false;
#ifdef LOOM_INFINIOPS_HAS_Copy
       copy = has_impl<io::Copy>(d);
#endif
       return copy || has_impl<io::Cast>(d);
     },
     copy_decline, copy_run},
#ifdef LOOM_INFINIOPS_HAS_Gelu
    // Loom's gelu is the tanh approximation; InfiniOps' Gelu is called with approximate = "tanh".
    {"gelu", "Gelu (approximate = tanh)", kFloats, "non-contiguous or broadcast views", has_impl<io::Gelu>,
     [](const Call& c) -> const char* {
       const Tensor &x = c.t("x"), &out = c.t("out");
       if (const char* r = unary_decline(c)) return r;
       if (!x.is_contiguous() || !out.is_contiguous()) return "a non-contiguous view";
       return nullptr;
     },
     [](const Call& c) {
       io::Operator<io::Gelu>::Call(c.handle(), io::Config{}, view(c.t("x")), std::string("tanh"), view(c.t("out")));
     }},
#endif
#ifdef LOOM_INFINIOPS_HAS_Softmax
    {"softmax", "Softmax", kFloats, "a dim other than the last", has_impl<io::Softmax>,
     [](const Call& c) -> const char* {
       const Tensor &x = c.t("x"), &out = c.t("out");
       if (const char* r = same_dtypes({&x, &out})) return r;
       if (int64_t(c.attr("dim", -1)) != x.dim() - 1) return "a dim other than the last";
       return mappable({&x, &out});
     },
     [](const Call& c) {
       const Tensor& x = c.t("x");
       io::Operator<io::Softmax>::Call(c.handle(), io::Config{}, view(x), int64_t(x.dim() - 1),
                                       std::optional<io::DataType>{}, view(c.t("out")));
     }},
#endif
#if defined(LOOM_INFINIOPS_HAS_RotaryEmbedding) && defined(LOOM_INFINIOPS_HAS_Copy)
    {"rope", "RotaryEmbedding (is_neox; Copy of x into out)", kFloats, "f64", rope_available, rope_decline,
     rope_run},
    {"rope_strided", "RotaryEmbedding (is_neox; Copy of x into out)", kFloats,
     "f64; a non-unit stride along D", rope_available, rope_decline, rope_run},
#endif
#ifdef LOOM_INFINIOPS_HAS_Embedding
    {"embedding", "Embedding", kFloats, "-", has_impl<io::Embedding>,
     [](const Call& c) -> const char* {
       const Tensor &w = c.t("weight"), &out = c.t("out");
       if (w.dtype() != out.dtype()) return "mixed dtypes";
       if (!out.is_contiguous()) return "a non-contiguous output";
       // Its row copy loads rows of an even width two elements at a time (float2, or a 32-bit word of two 16-bit
       // values) without checking that the rows are aligned to that (found by conformance on the H100: misaligned
       // address at an odd element offset).
       if (w.size(1) % 2 == 0 && w.stride(1) == 1) {
         const uintptr_t pair = 2 * uintptr_t(w.itemsize());
         const uintptr_t row_bytes = uintptr_t(w.stride(0)) * w.itemsize();
         if (uintptr_t(w.data()) % pair || uintptr_t(out.data()) % pair || row_bytes % pair)
           return "rows not aligned to two elements";
       }
       return mappable({&w, &c.t("indices"), &out});
     },
     [](const Call& c) {
       const Tensor &w = c.t("weight"), &idx = c.t("indices"), &out = c.t("out");
       const int64_t n = idx.numel();
       io::Operator<io::Embedding>::Call(c.handle(), io::Config{}, view(idx, {n}, {1}), view(w),
                                         view(out, {n, w.size(1)}, {w.size(1), 1}));
     }},
#endif
};

// Says once per (op, reason) why a call was declined, when LOOM_INFINIOPS_VERBOSE=1.
void note_decline(const std::string& op, const char* why) {
  static const bool verbose = [] {
    const char* v = std::getenv("LOOM_INFINIOPS_VERBOSE");
    return v && *v && *v != '0';
  }();
  if (!verbose) return;
  static std::mutex mu;
  static std::set<std::string> said;
  std::lock_guard<std::mutex> g(mu);
  if (said.insert(op + ": " + why).second) std::cerr << "[loom infiniops] " << op << " declined: " << why << "\n";
}

struct Registered {
  std::vector<RowInfo> rows;
};

// The loaded libinfiniops.so's path: verified routing keys its results by that file's content.
std::string infiniops_library_path() {
  std::string found;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        const std::string name = info->dlpi_name ? info->dlpi_name : "";
        if (name.find("libinfiniops") == std::string::npos) return 0;
        *static_cast<std::string*>(data) = name;
        return 1;
      },
      &found);
  return found;
}

Registered& registered() {
  static Registered r = [] {
    Registered out;
    for (const Row& row : kRows) {
      const OpSchema* schema = find_op_schema(row.op);
      LOOM_CHECK(schema, "infiniops: the table names op '", row.op, "', which Loom does not declare");
      RowInfo info{row.op, row.infini, row.dtypes, {}, row.declines};
      for (DeviceType dev : {kCPU, kCUDA}) {
        const auto idev = infini_device(dev);
        if (!idev || !row.available(*idev)) continue;
        const Row* r = &row;
        auto supports = [r, schema](const CallArgs& args) {
          const char* why = r->decline(Call{*schema, args, nullptr});
          if (why) note_decline(r->op, why);
          return why == nullptr;
        };
        auto kernel = [r, schema](const DeviceContext& ctx, const CallArgs& args) {
          r->run(Call{*schema, args, &ctx});
        };
        schema->register_erased(dev, kProviderName, row.dtypes, kPriority, kernel, supports,
                                "src/providers/infiniops/infiniops_provider.cc");
        info.devices.push_back(dev);
      }
      out.rows.push_back(std::move(info));
    }
    if (const std::string lib = infiniops_library_path(); !lib.empty())
      dispatch::declare_provider_library(kProviderName, lib, "infiniops");
    return out;
  }();
  return r;
}

// Registered when libloom loads, after the op descriptions of the headers above (declared earlier in this unit).
const bool kRegistered = (registered(), true);

}  // namespace

std::vector<RowInfo> rows() { return registered().rows; }

void set_fault_for_testing(Fault f) { g_fault.store(f); }

}  // namespace loom::providers::infiniops
