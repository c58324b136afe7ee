// DIOPI's runtime (diopirt.h), provided by Loom: a dlopen'd libdiopi_impl.so calls these to read its tensors,
// allocate memory and find the stream. Exported from libloom with C linkage and default visibility so the library's
// undefined symbols resolve against them. Every function checks its pointers and returns an error code; no C++
// exception crosses into the library.
#include <cstring>
#include <new>

#include "providers/diopi/diopi_handles.h"

namespace loom::diopi {

diopiDtype_t to_diopi(DType t) {
  switch (t) {
    case kF32: return diopi_dtype_float32;
    case kF64: return diopi_dtype_float64;
    case kF16: return diopi_dtype_float16;
    case kBF16: return diopi_dtype_bfloat16;
    case kI8: return diopi_dtype_int8;
    case kU8: return diopi_dtype_uint8;
    case kI32: return diopi_dtype_int32;
    case kI64: return diopi_dtype_int64;
    case kBool: return diopi_dtype_bool;
    case kF8E4M3: case kF8E5M2: break;  // DIOPI has no 8-bit floats
  }
  return diopi_dtype_unsupported;
}

bool from_diopi(diopiDtype_t t, DType& out) {
  switch (t) {
    case diopi_dtype_float32: out = kF32; return true;
    case diopi_dtype_float64: out = kF64; return true;
    case diopi_dtype_float16: out = kF16; return true;
    case diopi_dtype_bfloat16: out = kBF16; return true;
    case diopi_dtype_int8: out = kI8; return true;
    case diopi_dtype_uint8: out = kU8; return true;
    case diopi_dtype_int32: out = kI32; return true;
    case diopi_dtype_int64: out = kI64; return true;
    case diopi_dtype_bool: out = kBool; return true;
    default: return false;
  }
}

const char* diopi_dtype_name(diopiDtype_t t) {
  switch (t) {
    case diopi_dtype_int8: return "int8";
    case diopi_dtype_uint8: return "uint8";
    case diopi_dtype_int16: return "int16";
    case diopi_dtype_uint16: return "uint16";
    case diopi_dtype_int32: return "int32";
    case diopi_dtype_uint32: return "uint32";
    case diopi_dtype_int64: return "int64";
    case diopi_dtype_uint64: return "uint64";
    case diopi_dtype_float16: return "float16";
    case diopi_dtype_float32: return "float32";
    case diopi_dtype_float64: return "float64";
    case diopi_dtype_bool: return "bool";
    case diopi_dtype_bfloat16: return "bfloat16";
    case diopi_dtype_tfloat32: return "tfloat32";
    case diopi_dtype_complex32: return "complex32";
    case diopi_dtype_complex64: return "complex64";
    case diopi_dtype_complex128: return "complex128";
    default: return "unsupported";
  }
}

namespace {

const Tensor* get(diopiConstTensorHandle_t th) {
  return th && th->t.defined() ? &th->t : nullptr;
}

// Allocates for the library on the call's device (diopi_host: the CPU, whatever the call's device).
diopiError_t require(diopiContextHandle_t ctx, diopiTensorHandle_t* out, const Shape& shape, const Shape* strides,
                     DType dtype, diopiDevice_t device) {
  if (!ctx || !out || !ctx->device) return diopiErrorOccurred;
  try {
    const Device d = device == diopi_host ? Device() : ctx->device->device();
    if (device != diopi_host && d.is_cpu()) {
      ctx->error = "diopiRequireTensor asked for diopi_device memory in a call on the CPU";
      return diopiErrorOccurred;
    }
    Tensor t;
    if (!strides) {
      t = empty(shape, dtype, d);
    } else {
      if (strides->size() != shape.size()) {
        ctx->error = "diopiRequireTensor: stride has " + std::to_string(strides->size()) + " entries for " +
                     std::to_string(shape.size()) + " dims";
        return diopiErrorOccurred;
      }
      int64_t span = 1;  // elements from the first to one past the last, for non-negative strides
      bool empty_shape = false;
      for (size_t i = 0; i < shape.size(); ++i) {
        if (shape[i] == 0) empty_shape = true;
        if ((*strides)[i] < 0) {
          ctx->error = "diopiRequireTensor: negative stride";
          return diopiErrorOccurred;
        }
        span += (shape[i] - 1) * (*strides)[i];
      }
      t = empty({empty_shape ? 0 : span}, dtype, d).as_strided(shape, *strides, 0);
    }
    ctx->handles.push_back({t});
    *out = &ctx->handles.back();
    return diopiSuccess;
  } catch (const std::exception& e) {
    ctx->error = e.what();  // out of memory, a negative size
    return diopiErrorOccurred;
  }
}

Shape to_shape(const diopiSize_t* s) {
  Shape out;
  if (s && s->data)
    for (int64_t i = 0; i < s->len; ++i) out.push_back(s->data[i]);
  return out;
}

}  // namespace

thread_local const diopiContext* current_call = nullptr;

}  // namespace loom::diopi

using loom::diopi::get;

extern "C" {

__attribute__((visibility("default"))) diopiError_t diopiGetTensorData(diopiTensorHandle_t th, void** p) {
  const loom::Tensor* t = get(th);
  if (!t || !p) return diopiErrorOccurred;
  *p = t->data();
  return diopiSuccess;
}

__attribute__((visibility("default"))) diopiError_t diopiGetTensorDataConst(diopiConstTensorHandle_t th,
                                                                             const void** p) {
  const loom::Tensor* t = get(th);
  if (!t || !p) return diopiErrorOccurred;
  *p = t->data();
  return diopiSuccess;
}

// The arrays point into the handle's tensor, valid while the handle is (until the call ends).
__attribute__((visibility("default"))) diopiError_t diopiGetTensorShape(diopiConstTensorHandle_t th,
                                                                         diopiSize_t* size) {
  const loom::Tensor* t = get(th);
  if (!t || !size) return diopiErrorOccurred;
  *size = diopiSize_t{t->shape().data(), t->dim()};
  return diopiSuccess;
}

__attribute__((visibility("default"))) diopiError_t diopiGetTensorStride(diopiConstTensorHandle_t th,
                                                                          diopiSize_t* stride) {
  const loom::Tensor* t = get(th);
  if (!t || !stride) return diopiErrorOccurred;
  *stride = diopiSize_t{t->strides().data(), t->dim()};
  return diopiSuccess;
}

__attribute__((visibility("default"))) diopiError_t diopiGetTensorDtype(diopiConstTensorHandle_t th,
                                                                         diopiDtype_t* dtype) {
  const loom::Tensor* t = get(th);
  if (!t || !dtype) return diopiErrorOccurred;
  *dtype = loom::diopi::to_diopi(t->dtype());
  return diopiSuccess;
}

__attribute__((visibility("default"))) diopiError_t diopiGetTensorDevice(diopiConstTensorHandle_t th,
                                                                          diopiDevice_t* device) {
  const loom::Tensor* t = get(th);
  if (!t || !device) return diopiErrorOccurred;
  *device = t->device().is_cpu() ? diopi_host : diopi_device;
  return diopiSuccess;
}

__attribute__((visibility("default"))) diopiError_t diopiGetTensorNumel(diopiConstTensorHandle_t th,
                                                                         int64_t* numel) {
  const loom::Tensor* t = get(th);
  if (!t || !numel) return diopiErrorOccurred;
  *numel = t->numel();
  return diopiSuccess;
}

__attribute__((visibility("default"))) diopiError_t diopiGetTensorElemSize(diopiConstTensorHandle_t th,
                                                                            int64_t* itemsize) {
  const loom::Tensor* t = get(th);
  if (!t || !itemsize) return diopiErrorOccurred;
  *itemsize = int64_t(t->itemsize());
  return diopiSuccess;
}

__attribute__((visibility("default"))) diopiError_t diopiGetTensorStoragePtr(diopiConstTensorHandle_t th,
                                                                              void** ptr) {
  const loom::Tensor* t = get(th);
  if (!t || !ptr) return diopiErrorOccurred;
  *ptr = t->storage()->data();
  return diopiSuccess;
}

__attribute__((visibility("default"))) diopiError_t diopiGetTensorStorageOffset(diopiConstTensorHandle_t th,
                                                                                 int64_t* offset) {
  const loom::Tensor* t = get(th);
  if (!t || !offset) return diopiErrorOccurred;
  *offset = t->storage_offset();
  return diopiSuccess;
}

__attribute__((visibility("default"))) diopiError_t diopiGetTensorStorageNbytes(diopiConstTensorHandle_t th,
                                                                                 size_t* nbytes) {
  const loom::Tensor* t = get(th);
  if (!t || !nbytes) return diopiErrorOccurred;
  *nbytes = t->storage()->nbytes();
  return diopiSuccess;
}

__attribute__((visibility("default"))) diopiError_t diopiGetTensorDeviceIndex(diopiConstTensorHandle_t th,
                                                                               diopiDeviceIndex_t* index) {
  const loom::Tensor* t = get(th);
  if (!t || !index) return diopiErrorOccurred;
  *index = diopiDeviceIndex_t(t->device().is_cpu() ? 0 : t->device().index);
  return diopiSuccess;
}

// Loom tensors are dense: there are no sparse parts to hand out.
__attribute__((visibility("default"))) diopiError_t diopiGetTensorCrowIndices(diopiConstTensorHandle_t,
                                                                               diopiConstTensorHandle_t* out) {
  if (out) *out = nullptr;
  return diopiNoImplement;
}
__attribute__((visibility("default"))) diopiError_t diopiGetTensorColIndices(diopiConstTensorHandle_t,
                                                                              diopiConstTensorHandle_t* out) {
  if (out) *out = nullptr;
  return diopiNoImplement;
}
__attribute__((visibility("default"))) diopiError_t diopiGetTensorValues(diopiConstTensorHandle_t,
                                                                          diopiConstTensorHandle_t* out) {
  if (out) *out = nullptr;
  return diopiNoImplement;
}
__attribute__((visibility("default"))) diopiError_t diopiIsTensorSparse(diopiConstTensorHandle_t th,
                                                                         bool* is_sparse) {
  if (!get(th) || !is_sparse) return diopiErrorOccurred;
  *is_sparse = false;
  return diopiSuccess;
}

// The device of the call in progress on this thread (0 outside a call, and on the CPU).
__attribute__((visibility("default"))) diopiError_t diopiGetCurrentDeviceIndex(diopiDeviceIndex_t* index) {
  if (!index) return diopiErrorOccurred;
  const diopiContext* c = loom::diopi::current_call;
  *index = diopiDeviceIndex_t(c && c->device && !c->device->device().is_cpu() ? c->device->device().index : 0);
  return diopiSuccess;
}

// The stream the call runs on: the cudaStream_t of the call's DeviceContext on CUDA (Loom orders later work after
// it), null on the CPU.
__attribute__((visibility("default"))) diopiError_t diopiGetStream(diopiContextHandle_t ctx,
                                                                    diopiStreamHandle_t* stream) {
  if (!ctx || !ctx->device || !stream) return diopiErrorOccurred;
  *stream = ctx->device->stream().handle;
  return diopiSuccess;
}

__attribute__((visibility("default"))) diopiError_t diopiRequireTensor(diopiContextHandle_t ctx,
                                                                        diopiTensorHandle_t* tensor,
                                                                        const diopiSize_t* size,
                                                                        const diopiSize_t* stride,
                                                                        const diopiDtype_t dtype,
                                                                        const diopiDevice_t device) {
  if (!ctx || !size) return diopiErrorOccurred;
  loom::DType t;
  if (!loom::diopi::from_diopi(dtype, t)) {
    ctx->error = std::string("diopiRequireTensor: Loom has no dtype ") + loom::diopi::diopi_dtype_name(dtype);
    return diopiDtypeNotSupported;
  }
  const loom::Shape shape = loom::diopi::to_shape(size);
  const loom::Shape strides = loom::diopi::to_shape(stride);
  return loom::diopi::require(ctx, tensor, shape, stride && stride->data ? &strides : nullptr, t, device);
}

__attribute__((visibility("default"))) diopiError_t diopiRequireBuffer(diopiContextHandle_t ctx,
                                                                        diopiTensorHandle_t* tensor,
                                                                        int64_t num_bytes, diopiDevice_t device) {
  if (!ctx || num_bytes < 0) return diopiErrorOccurred;
  return loom::diopi::require(ctx, tensor, {num_bytes}, nullptr, loom::kU8, device);
}

// A generator's state as a tensor: two int64 on the host, seed then offset (in Philox blocks).
__attribute__((visibility("default"))) diopiError_t diopiGeneratorGetState(diopiContextHandle_t ctx,
                                                                            diopiConstGeneratorHandle_t gen,
                                                                            diopiTensorHandle_t* data) {
  if (!ctx || !gen || !data) return diopiErrorOccurred;
  diopiError_t e = loom::diopi::require(ctx, data, {2}, nullptr, loom::kI64, diopi_host);
  if (e != diopiSuccess) return e;
  int64_t* p = (*data)->t.data_ptr<int64_t>();
  p[0] = int64_t(gen->state.seed);
  p[1] = int64_t(gen->state.offset);
  return diopiSuccess;
}

__attribute__((visibility("default"))) diopiError_t diopiGeneratorSetState(diopiGeneratorHandle_t gen,
                                                                            diopiConstTensorHandle_t state) {
  const loom::Tensor* t = get(state);
  if (!gen || !t || t->numel() != 2 || t->dtype() != loom::kI64 || !t->device().is_cpu() || !t->is_contiguous())
    return diopiErrorOccurred;
  const int64_t* p = t->data_ptr<int64_t>();
  gen->state.seed = uint64_t(p[0]);
  gen->state.offset = uint64_t(p[1]);
  return diopiSuccess;
}

__attribute__((visibility("default"))) diopiError_t diopiGeneratorGetSeedAndOffset(diopiGeneratorHandle_t gen,
                                                                                    uint64_t* seed,
                                                                                    uint64_t* offset) {
  if (!gen || !seed || !offset) return diopiErrorOccurred;
  *seed = gen->state.seed;
  *offset = gen->state.offset;
  return diopiSuccess;
}

__attribute__((visibility("default"))) diopiError_t diopiGeneratorSetSeedAndOffset(diopiGeneratorHandle_t gen,
                                                                                    uint64_t seed,
                                                                                    uint64_t offset) {
  if (!gen) return diopiErrorOccurred;
  gen->state = {seed, offset};
  return diopiSuccess;
}

// Profiling records: Loom's op profiling (LOOM_PROFILE_OPS) already times each bridged call as a whole, so a
// library's inner records are accepted and dropped.
__attribute__((visibility("default"))) diopiError_t diopiRecordStart(const char*, void** record) {
  if (record) *record = nullptr;
  return diopiSuccess;
}
__attribute__((visibility("default"))) diopiError_t diopiRecordEnd(void** record) {
  if (record) *record = nullptr;
  return diopiSuccess;
}

}  // extern "C"
