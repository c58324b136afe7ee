// What a vendor library wrote, told to compute-sanitizer's initcheck.
//
// initcheck tracks which bytes of device memory a kernel stored, but not the bulk (TMA) stores of cuBLASLt's and
// cuDNN's Hopper kernels: every later read of a gemm's product or of cuDNN attention's output would be reported as a
// read of memory nothing wrote. After such a call Loom marks the output it asked for as written, through the NVTX
// memory API that compute-sanitizer reads (nvtxMemCudaMarkInitialized). What a call writes without reading it (a
// gemm's C when beta is 0, cuDNN's outputs) is marked before the call as well: some cuBLASLt algorithms run a second
// kernel inside the call that reads back what the first stored in bulk (an epilogue after a split-K product). An
// input is never marked, so a vendor call that reads memory nothing wrote is still reported. Without a tool attached
// the call returns at once; Loom's own kernels are never marked, so initcheck judges every one of them.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace loom {

class Tensor;

namespace cuda {

// The bytes [data, data + bytes) as written on `stream`.
void mark_vendor_written(const void* data, size_t bytes, cudaStream_t stream);
// A column-major matrix batch (m x n, leading dimension ld, batch stride in elements) of `element_bytes` each:
// the span from its first element to its last, the gaps between columns included.
void mark_vendor_written(const void* data, int64_t m, int64_t n, int64_t ld, int64_t batch, int64_t batch_stride,
                         size_t element_bytes, cudaStream_t stream);
// The memory a tensor spans, from its first element to its last.
void mark_vendor_written(const Tensor& t, cudaStream_t stream);

}  // namespace cuda
}  // namespace loom
