// The seeded counter-based random generator (Philox4x32-10). Element i of a draw depends only on
// (seed, offset, i), so a seed gives the same numbers on every run, thread count and device.
#pragma once

#include <cstdint>
#include <mutex>

#include "loom/common/half.h"
#include "loom/core/op_schema.h"

namespace loom {

struct PhiloxState {
  uint64_t seed = 0;
  uint64_t offset = 0;  // in 4-number blocks already consumed
  LOOM_FIELDS(PhiloxState, seed, offset);
};

// One Philox4x32-10 block: four 32-bit numbers for counter (offset + block) under key seed.
LOOM_HOST_DEVICE inline void philox4x32(uint64_t seed, uint64_t counter, uint32_t out[4]) {
  uint32_t c0 = uint32_t(counter), c1 = uint32_t(counter >> 32), c2 = 0, c3 = 0;
  uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
  for (int r = 0; r < 10; ++r) {
    uint64_t p0 = uint64_t(0xD2511F53u) * c0;
    uint64_t p1 = uint64_t(0xCD9E8D57u) * c2;
    uint32_t n0 = uint32_t(p1 >> 32) ^ c1 ^ k0;
    uint32_t n2 = uint32_t(p0 >> 32) ^ c3 ^ k1;
    c1 = uint32_t(p1);
    c3 = uint32_t(p0);
    c0 = n0;
    c2 = n2;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

// Uniform in [0, 1) with 24 bits, element i of the stream.
LOOM_HOST_DEVICE inline float philox_uniform(PhiloxState s, uint64_t i) {
  uint32_t r[4];
  philox4x32(s.seed, s.offset + i / 4, r);
  return float(r[i % 4] >> 8) * (1.0f / 16777216.0f);
}

// The seeds and offsets the conformance suite tries for an op that draws from a Philox stream: small ones, a seed
// past 32 bits (the key's high word), and the offset 2^32 - 1, where the counter's high word takes over four
// elements in. A run's generator passes it: each draw advances it by a quarter of the elements drawn, and GPT-2 124M
// with dropout at 8 x 1024 tokens draws 2^27 a step. Functions, not variables: descriptions are built during static
// initialization.
inline std::vector<AttrValue> philox_seeds() {
  return {AttrValue::of_int(7), AttrValue::of_int(12345), AttrValue::of_int(0x100000007)};
}
inline std::vector<AttrValue> philox_offsets() {
  return {AttrValue::of_int(0), AttrValue::of_int(3), AttrValue::of_int(0xffffffff)};
}

class Generator {
 public:
  explicit Generator(uint64_t seed = 0x5eed) : state_{seed, 0} {}
  void manual_seed(uint64_t seed) {
    std::lock_guard<std::mutex> g(mu_);
    state_ = {seed, 0};
  }
  // Reserves room for n numbers and returns the state to draw them from.
  PhiloxState advance(uint64_t n) {
    std::lock_guard<std::mutex> g(mu_);
    PhiloxState s = state_;
    state_.offset += (n + 3) / 4;
    return s;
  }
  PhiloxState state() const { return state_; }
  void set_state(PhiloxState s) { state_ = s; }

 private:
  PhiloxState state_;
  std::mutex mu_;
};

Generator& default_generator();
inline void manual_seed(uint64_t seed) { default_generator().manual_seed(seed); }

}  // namespace loom
