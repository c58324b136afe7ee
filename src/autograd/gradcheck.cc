// gradcheck: analytic gradients of sum(f(x) * r) against central finite differences.
#include "loom/autograd/gradcheck.h"

#include <cmath>
#include <sstream>

#include "loom/autograd/engine.h"
#include "loom/autograd/grad_mode.h"
#include "loom/functional.h"

namespace loom::autograd {

GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f, const std::vector<Tensor>& inputs,
                          double eps, double atol, double rtol) {
  GradcheckResult result;
  std::vector<Tensor> xs;
  for (const Tensor& x : inputs) {
    Tensor c = ops::clone(x.detach());
    if (x.requires_grad()) c.set_requires_grad(true);
    xs.push_back(c);
  }
  Tensor y = f(xs);
  LOOM_REQUIRE(y.requires_grad(), "gradcheck: the function's output does not require grad");
  Generator gen(0x9c4ec);
  Tensor r = rand(y.shape(), y.dtype(), y.device(), &gen, 0.5, 1.5);
  auto objective = [&](const std::vector<Tensor>& in) {
    NoGradGuard ng;
    Tensor out = f(in);
    return ops::sum(ops::mul(ops::to_dtype(out, kF64), ops::to_dtype(r, kF64))).item<double>();
  };
  Tensor loss = sum(mul(y, r));
  backward({loss});

  for (size_t i = 0; i < xs.size(); ++i) {
    if (!inputs[i].requires_grad()) continue;
    Tensor analytic = xs[i].grad();
    std::vector<double> a = analytic.defined() ? to_vector<double>(analytic) : std::vector<double>(xs[i].numel(), 0.0);
    Tensor probe = ops::contiguous(ops::to_dtype(xs[i].detach(), kF64));
    std::vector<Tensor> in;
    for (const Tensor& x : xs) in.push_back(x.detach());
    double* p = static_cast<double*>(probe.data());
    for (int64_t k = 0; k < probe.numel(); ++k) {
      double orig = p[k];
      p[k] = orig + eps;
      in[i] = ops::to_dtype(probe, xs[i].dtype());
      double plus = objective(in);
      p[k] = orig - eps;
      in[i] = ops::to_dtype(probe, xs[i].dtype());
      double minus = objective(in);
      p[k] = orig;
      double numeric = (plus - minus) / (2 * eps);
      double err = std::abs(a[size_t(k)] - numeric) / (atol + rtol * std::abs(numeric));
      if (!(err <= result.max_error)) result.max_error = std::isnan(err) ? INFINITY : err;
      if (!(err <= 1.0) && result.ok) {
        result.ok = false;
        std::ostringstream os;
        os << "input " << i << " element " << k << ": analytic " << a[size_t(k)] << " vs numeric " << numeric;
        result.message = os.str();
      }
    }
  }
  return result;
}

}  // namespace loom::autograd
