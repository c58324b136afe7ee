// vendor_writes.h: the NVTX calls compute-sanitizer's initcheck reads.
#include "backends/cuda/vendor_writes.h"

#include <nvtx3/nvToolsExtMemCudaRt.h>

#include "loom/core/tensor.h"

namespace loom::cuda {
namespace {

nvtxDomainHandle_t domain() {
  static nvtxDomainHandle_t d = nvtxDomainCreateA("loom");
  return d;
}

}  // namespace

void mark_vendor_written(const void* data, size_t bytes, cudaStream_t stream) {
  if (data == nullptr || bytes == 0) return;
  nvtxMemVirtualRangeDesc_t range{};
  range.ptr = data;
  range.size = bytes;
  nvtxMemMarkInitializedBatch_t batch{};
  batch.extCompatID = NVTX_EXT_COMPATID_MEM;
  batch.structSize = sizeof(batch);
  batch.regionType = NVTX_MEM_TYPE_VIRTUAL_ADDRESS;
  batch.regionDescCount = 1;
  batch.regionDescElementSize = sizeof(range);
  batch.regionDescElements = &range;
  nvtxMemCudaMarkInitialized(domain(), stream, 0, &batch);
}

void mark_vendor_written(const void* data, int64_t m, int64_t n, int64_t ld, int64_t batch, int64_t batch_stride,
                         size_t element_bytes, cudaStream_t stream) {
  if (m <= 0 || n <= 0 || batch <= 0) return;
  const int64_t span = (batch - 1) * batch_stride + (n - 1) * ld + m;
  mark_vendor_written(data, size_t(span) * element_bytes, stream);
}

void mark_vendor_written(const Tensor& t, cudaStream_t stream) {
  if (!t.defined() || t.numel() == 0) return;
  mark_vendor_written(t.data(), size_t(span_of(t.shape(), t.strides())) * t.itemsize(), stream);
}

}  // namespace loom::cuda
