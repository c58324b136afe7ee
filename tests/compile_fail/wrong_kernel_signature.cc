// Negative compile test: registering a kernel whose signature differs from the op's must not compile.
#include "kernels/copy_kernel.h"

namespace loom {
#ifdef LOOM_USE_RIGHT_SIGNATURE
void my_fill(const DeviceContext&, const FillAttrs&, Tensor&) {}
#else
void my_fill(const DeviceContext&, const FillAttrs&, const Tensor&) {}  // output taken as const: wrong signature
#endif
LOOM_REGISTER_KERNEL(fill, kCPU, "test", dtypes(kF32), my_fill);
}  // namespace loom
