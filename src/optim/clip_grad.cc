// Global-norm gradient clipping: sums of squares land in one f64 buffer per device, read back once. Gradients that
// tile a range of one storage side by side (an optimizer's flat gradient buffer) are measured and scaled as that
// one range: one norm kernel and one scale kernel per run instead of one per parameter.
#include "loom/optim/clip_grad.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "loom/autograd/grad_mode.h"
#include "loom/ops/elementwise.h"
#include "loom/optim/update_ops.h"

namespace loom::optim {

namespace {

// The tensors to measure and scale for `grads` (all on one device): each maximal run of contiguous gradients of one
// dtype that follow each other in one storage (gaps break a run) becomes one 1-D view; the rest stay as they are.
// If two gradients overlap (one tensor listed twice, say), every gradient stays as it is, so each counts as often
// as it is listed.
std::vector<Tensor> merged_ranges(const std::vector<Tensor>& grads) {
  std::vector<const Tensor*> flat, other;
  for (const Tensor& g : grads) (g.is_contiguous() && g.numel() > 0 ? flat : other).push_back(&g);
  std::sort(flat.begin(), flat.end(), [](const Tensor* a, const Tensor* b) {
    if (a->storage() != b->storage()) return std::less<const Storage*>()(a->storage().get(), b->storage().get());
    return a->storage_offset() < b->storage_offset();
  });
  std::vector<Tensor> out;
  for (size_t i = 0; i < flat.size();) {
    const Tensor& first = *flat[i];
    int64_t end = first.storage_offset() + first.numel();
    size_t j = i + 1;
    for (; j < flat.size() && flat[j]->storage() == first.storage() && flat[j]->dtype() == first.dtype(); ++j) {
      if (flat[j]->storage_offset() < end) return grads;  // overlap
      if (flat[j]->storage_offset() != end) break;
      end += flat[j]->numel();
    }
    if (j < flat.size() && flat[j]->storage() == first.storage() && flat[j]->storage_offset() < end) return grads;
    out.push_back(j == i + 1 ? first : first.as_strided({end - first.storage_offset()}, {1}, first.storage_offset()));
    i = j;
  }
  for (const Tensor* g : other) out.push_back(*g);
  return out;
}

}  // namespace

namespace {

std::vector<Tensor> defined_grads(const std::vector<Tensor>& params) {
  std::vector<Tensor> grads;
  for (const Tensor& p : params) {
    LOOM_REQUIRE(p.defined(), "clip_grad_norm: a parameter is undefined");
    Tensor g = p.grad();
    if (g.defined()) grads.push_back(g);
  }
  return grads;
}

}  // namespace

ClipCoefficient clip_coefficient_on_device(const std::vector<Tensor>& params, double max_norm) {
  autograd::NoGradGuard no_grad;
  const std::vector<Tensor> grads = defined_grads(params);
  const Device device = grads.empty() ? (params.empty() ? Device() : params.front().device()) : grads.front().device();
  for (const Tensor& g : grads)
    LOOM_REQUIRE(g.device() == device, "clip_grad_norm_on_device: gradients on ", device.str(), " and ",
                 g.device().str(), "; it measures one device's");
  std::vector<Tensor> ranges = merged_ranges(grads);
  Tensor total = zeros({}, kF64, device);
  if (!ranges.empty()) {
    Tensor sums = empty({int64_t(ranges.size())}, kF64, device);
    for (size_t k = 0; k < ranges.size(); ++k) {
      Tensor slot = sums.select(0, int64_t(k));
      grad_norm_squared_out(ranges[k], slot);
    }
    // Summed one by one in order, as a host loop would: the norm does not depend on a reduction's tree.
    for (size_t k = 0; k < ranges.size(); ++k) total = ops::add(total, sums.select(0, int64_t(k)));
  }
  ClipCoefficient out;
  out.norm = ops::sqrt(total);
  if (max_norm > 0 && !ranges.empty()) {
    const Tensor& norm = out.norm;
    const Tensor one = ones({}, kF64, device);
    const Tensor coef = ops::div(full({}, max_norm, kF64, device), ops::add(norm, 1e-6));
    // A non-finite norm scales nothing (the caller decides); norm < the largest double is false for inf and NaN
    // (a finite bound: op traces record attributes as JSON numbers).
    const Tensor finite_coef = ops::where(ops::lt(norm, std::numeric_limits<double>::max()), coef, one);
    out.scale = ops::where(ops::gt(norm, max_norm), finite_coef, one);
  }
  return out;
}

void scale_grads(const std::vector<Tensor>& params, const Tensor& scale) {
  autograd::NoGradGuard no_grad;
  for (Tensor& r : merged_ranges(defined_grads(params))) scale_grad_(r, scale);
}

Tensor clip_grad_norm_on_device(const std::vector<Tensor>& params, double max_norm) {
  ClipCoefficient clip = clip_coefficient_on_device(params, max_norm);
  if (clip.scale.defined()) scale_grads(params, clip.scale);
  return clip.norm;
}

double clip_grad_norm(const std::vector<Tensor>& params, double max_norm) {
  autograd::NoGradGuard no_grad;
  std::vector<Tensor> grads = defined_grads(params);
  bool one_device = true;
  for (const Tensor& g : grads) one_device = one_device && g.device() == grads.front().device();
  if (one_device) return clip_grad_norm_on_device(params, max_norm).item<double>();
  // One buffer per device so that each device is read back once, not once per tensor.
  std::vector<Device> devices;
  std::vector<std::vector<Tensor>> members;
  for (const Tensor& g : grads) {
    size_t d = 0;
    while (d < devices.size() && devices[d] != g.device()) ++d;
    if (d == devices.size()) devices.push_back(g.device()), members.emplace_back();
    members[d].push_back(g);
  }
  double total = 0;
  std::vector<Tensor> ranges;
  for (size_t d = 0; d < devices.size(); ++d) {
    std::vector<Tensor> device_ranges = merged_ranges(members[d]);
    Tensor sums = empty({int64_t(device_ranges.size())}, kF64, devices[d]);
    for (size_t k = 0; k < device_ranges.size(); ++k) {
      Tensor slot = sums.select(0, int64_t(k));
      grad_norm_squared_out(device_ranges[k], slot);
    }
    for (double s : to_vector<double>(sums)) total += s;
    ranges.insert(ranges.end(), device_ranges.begin(), device_ranges.end());
  }
  double norm = std::sqrt(total);
  if (max_norm > 0 && std::isfinite(norm) && norm > max_norm) {
    double scale = max_norm / (norm + 1e-6);
    for (Tensor& r : ranges) ops::mul_(r, scale);
  }
  return norm;
}

}  // namespace loom::optim
