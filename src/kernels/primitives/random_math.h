// The math of a random draw, shared by the CPU and CUDA kernels so that both give the same numbers.
#pragma once

#include <cmath>

#include "kernels/copy_kernel.h"

namespace loom {

// Element i of a draw. Normal draws use Box-Muller on the pair (2*(i/2), 2*(i/2)+1) of uniforms, cosine for even i
// and sine for odd, so one pair of uniforms makes two normals.
LOOM_HOST_DEVICE inline double random_value(const RandomAttrs& a, uint64_t i) {
  if (a.distribution == Distribution::kUniform) {
    return a.a + (a.b - a.a) * double(philox_uniform(a.state, i));
  }
  uint64_t pair = i / 2 * 2;
  float u1 = philox_uniform(a.state, pair);
  float u2 = philox_uniform(a.state, pair + 1);
  float radius = sqrtf(-2.0f * logf(1.0f - u1));  // 1 - u1 is in (0, 1]: no log(0)
  float theta = 6.2831853071795864f * u2;
  float z = (i % 2 == 0) ? radius * cosf(theta) : radius * sinf(theta);
  return a.a + a.b * double(z);
}

}  // namespace loom
