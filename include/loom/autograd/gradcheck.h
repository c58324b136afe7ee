// Finite-difference gradient checks in float64.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "loom/core/tensor.h"

namespace loom::autograd {

struct GradcheckResult {
  bool ok = true;
  std::string message;  // the worst mismatch when !ok
  double max_error = 0;  // max |analytic - numeric| / (atol + rtol * |numeric|)
};

// Checks the gradients of L = sum(f(inputs) * r) for a fixed random r against central differences, for every input
// that requires grad. Inputs should be f64 (the check converts nothing). f may return one tensor.
GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f, const std::vector<Tensor>& inputs,
                          double eps = 1e-6, double atol = 1e-6, double rtol = 1e-4);

}  // namespace loom::autograd
