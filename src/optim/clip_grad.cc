// Global-norm gradient clipping: per-tensor sums of squares land in one f64 buffer per device, read back once.
#include "loom/optim/clip_grad.h"

#include <cmath>

#include "loom/autograd/grad_mode.h"
#include "loom/ops/elementwise.h"
#include "loom/optim/update_ops.h"

namespace loom::optim {

double clip_grad_norm(const std::vector<Tensor>& params, double max_norm) {
  autograd::NoGradGuard no_grad;
  std::vector<Tensor> grads;
  for (const Tensor& p : params) {
    LOOM_REQUIRE(p.defined(), "clip_grad_norm: a parameter is undefined");
    Tensor g = p.grad();
    if (g.defined()) grads.push_back(g);
  }
  // One buffer per device so that each device is read back once, not once per tensor.
  std::vector<Device> devices;
  std::vector<std::vector<size_t>> members;
  for (size_t i = 0; i < grads.size(); ++i) {
    size_t d = 0;
    while (d < devices.size() && devices[d] != grads[i].device()) ++d;
    if (d == devices.size()) devices.push_back(grads[i].device()), members.emplace_back();
    members[d].push_back(i);
  }
  double total = 0;
  for (size_t d = 0; d < devices.size(); ++d) {
    Tensor sums = empty({int64_t(members[d].size())}, kF64, devices[d]);
    for (size_t k = 0; k < members[d].size(); ++k) {
      Tensor slot = sums.select(0, int64_t(k));
      grad_norm_squared_out(grads[members[d][k]], slot);
    }
    for (double s : to_vector<double>(sums)) total += s;
  }
  double norm = std::sqrt(total);
  if (max_norm > 0 && std::isfinite(norm) && norm > max_norm) {
    double scale = max_norm / (norm + 1e-6);
    for (Tensor& g : grads) ops::mul_(g, scale);
  }
  return norm;
}

}  // namespace loom::optim
