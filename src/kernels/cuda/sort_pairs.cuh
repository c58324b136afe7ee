// A stable sort of n (key, value) pairs by key on the GPU, as the embedding's backward and the mixture of experts'
// permutation take it: uint32 keys, int32 values, CUB's radix sort over only the bits a key can set.
#pragma once

#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <cstdint>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_context.h"
#include "kernels/cuda/reduce_nn_common.cuh"

namespace loom::cuda {

// The pairs' four arrays (the keys and values as given, then sorted) in one scratch buffer of the context's, each
// array n rounded up to 64 elements (256-byte aligned starts). The caller fills keys_in and values_in, then sort().
struct SortPairs {
  SortPairs(const DeviceContext& ctx, int64_t count)
      : n(count), padded((std::max<int64_t>(count, 1) + 63) / 64 * 64), buffer(scratch_bytes(ctx, 4 * padded * 4)) {
    keys_in = static_cast<uint32_t*>(buffer.data());
    keys_sorted = keys_in + padded;
    values_in = reinterpret_cast<int32_t*>(keys_sorted + padded);
    values_sorted = values_in + padded;
  }
  // Sorts the n pairs by key (stable: equal keys keep their values' order), the keys at most `largest_key`.
  void sort(const DeviceContext& ctx, uint64_t largest_key, cudaStream_t stream) {
    if (n == 0) return;
    int end_bit = 1;  // the fewest bits that hold largest_key
    while (end_bit < 32 && (uint64_t(1) << end_bit) <= largest_key) ++end_bit;
    size_t temp_bytes = 0;
    LOOM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys_in, keys_sorted, values_in,
                                                    values_sorted, int(n), 0, end_bit, stream));
    Tensor temp = scratch_bytes(ctx, int64_t(temp_bytes));
    LOOM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.data(), temp_bytes, keys_in, keys_sorted, values_in,
                                                    values_sorted, int(n), 0, end_bit, stream));
  }
  int64_t n, padded;
  Tensor buffer;
  uint32_t* keys_in = nullptr;
  uint32_t* keys_sorted = nullptr;
  int32_t* values_in = nullptr;
  int32_t* values_sorted = nullptr;
};

}  // namespace loom::cuda
