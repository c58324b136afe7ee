// Differentiable ops whose backward saves an input only for another input's gradient (a product saves x only for
// the weight's gradient): with only some inputs requiring grad, as with frozen weights (LoRA's base, frozen experts),
// the backward must not touch what it did not save. Each multi-input op is checked against central differences with
// every single input requiring grad alone, then all of them.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "loom/autograd/gradcheck.h"
#include "loom/functional.h"
#include "loom/moe.h"
#include "test_util.h"

namespace loom {
namespace {

struct Case {
  std::string name;
  std::vector<Tensor> inputs;  // f64, none requiring grad yet
  std::function<Tensor(const std::vector<Tensor>&)> f;
  std::vector<size_t> differentiable;  // the inputs with a gradient (the others are indices, tables...)
};

void check_each_input_alone(const Case& c) {
  std::vector<std::vector<size_t>> subsets;
  for (size_t i : c.differentiable) subsets.push_back({i});
  subsets.push_back(c.differentiable);
  for (const auto& subset : subsets) {
    std::vector<Tensor> in;
    for (const Tensor& t : c.inputs) in.push_back(t.defined() ? t.detach().clone() : t);
    std::string which;
    for (size_t i : subset) {
      in[i].set_requires_grad(true);
      which += (which.empty() ? "" : ",") + std::to_string(i);
    }
    SCOPED_TRACE(c.name + " with inputs {" + which + "} requiring grad");
    autograd::GradcheckResult r;
    ASSERT_NO_THROW(r = autograd::gradcheck(c.f, in));
    EXPECT_TRUE(r.ok) << r.message;
  }
}

Tensor rand64(const Shape& s, double lo = -1, double hi = 1) { return test::random_tensor(s, kF64, lo, hi); }

TEST(PartialGradients, EachInputAloneMatchesCentralDifferences) {
  const int64_t T = 5, C = 4, H = 6;
  std::vector<Case> cases;
  cases.push_back({"matmul", {rand64({T, C}), rand64({C, H})},
                   [](const std::vector<Tensor>& in) { return matmul(in[0], in[1]); }, {0, 1}});
  cases.push_back({"linear", {rand64({T, C}), rand64({H, C}), rand64({H})},
                   [](const std::vector<Tensor>& in) { return linear(in[0], in[1], in[2]); }, {0, 1, 2}});
  cases.push_back({"linear_gelu", {rand64({T, C}), rand64({H, C}), rand64({H})},
                   [](const std::vector<Tensor>& in) { return linear_gelu(in[0], in[1], in[2]); }, {0, 1, 2}});
  for (bool recompute : {false, true})
    cases.push_back({std::string("gelu_mlp") + (recompute ? " (hidden recomputed)" : ""),
                     {rand64({T, C}), rand64({H, C}), rand64({H}), rand64({C, H}), rand64({C})},
                     [recompute](const std::vector<Tensor>& in) {
                       return gelu_mlp(in[0], in[1], in[2], in[3], in[4], {}, recompute);
                     },
                     {0, 1, 2, 3, 4}});
  cases.push_back({"mul", {rand64({T, C}), rand64({T, C})},
                   [](const std::vector<Tensor>& in) { return mul(in[0], in[1]); }, {0, 1}});
  cases.push_back({"div", {rand64({T, C}), rand64({T, C}, 0.5, 2)},
                   [](const std::vector<Tensor>& in) { return div(in[0], in[1]); }, {0, 1}});
  cases.push_back({"swiglu", {rand64({T, C}), rand64({T, C})},
                   [](const std::vector<Tensor>& in) { return swiglu(in[0], in[1]); }, {0, 1}});
  cases.push_back({"layer_norm", {rand64({T, C}), rand64({C}), rand64({C})},
                   [](const std::vector<Tensor>& in) { return layer_norm(in[0], in[1], in[2]); }, {0, 1, 2}});
  cases.push_back({"rms_norm", {rand64({T, C}), rand64({C})},
                   [](const std::vector<Tensor>& in) { return rms_norm(in[0], in[1]); }, {0, 1}});
  cases.push_back({"residual_layer_norm", {rand64({T, C}), rand64({T, C}), rand64({C}), rand64({C})},
                   [](const std::vector<Tensor>& in) {
                     auto [residual, normed] = residual_layer_norm(in[0], in[1], in[2], in[3]);
                     return add(residual, normed);
                   },
                   {0, 1, 2, 3}});
  cases.push_back({"residual_rms_norm", {rand64({T, C}), rand64({T, C}), rand64({C})},
                   [](const std::vector<Tensor>& in) {
                     auto [residual, normed] = residual_rms_norm(in[0], in[1], in[2]);
                     return add(residual, normed);
                   },
                   {0, 1, 2}});
  cases.push_back({"linear_cross_entropy", {rand64({T, C}), rand64({H, C}), test::random_indices({T}, 0, H)},
                   [](const std::vector<Tensor>& in) { return linear_cross_entropy(in[0], in[1], in[2]); }, {0, 1}});
  cases.push_back({"scaled_dot_product_attention", {rand64({1, 2, T, C}), rand64({1, 2, T, C}), rand64({1, 2, T, C})},
                   [](const std::vector<Tensor>& in) { return scaled_dot_product_attention(in[0], in[1], in[2]); },
                   {0, 1, 2}});
  for (bool tb : {false, true})
    cases.push_back({std::string("grouped_gemm") + (tb ? " (b transposed)" : ""),
                     {rand64({9, C}), rand64(tb ? Shape{3, H, C} : Shape{3, C, H})},
                     [tb](const std::vector<Tensor>& in) { return grouped_gemm(in[0], in[1], {4, 0, 5}, tb); },
                     {0, 1}});
  {
    const int64_t E = 3, K = 2;
    Tensor experts = test::random_indices({T, K}, 0, E);
    Tensor scale = rand64({T * K, C});
    cases.push_back({"moe_permute and moe_unpermute", {rand64({T, C}), rand64({T, K}, 0.1, 1)},
                     [=](const std::vector<Tensor>& in) {
                       ops::MoePermutation p = moe_permute(in[0], experts, E);
                       return moe_unpermute(mul(p.out, scale), p, in[1]);
                     },
                     {0, 1}});
  }
  // lora_add with y a leaf (added in a copy) and with y computed inside (added in y's own buffer).
  cases.push_back({"lora_add", {rand64({T, H}), rand64({T, 3}), rand64({H, 3})},
                   [](const std::vector<Tensor>& in) { return lora_add(in[0], in[1], in[2], 1.5); }, {0, 1, 2}});
  cases.push_back({"lora_add of a product", {rand64({T, C}), rand64({T, 3}), rand64({H, 3}), rand64({H, C})},
                   [](const std::vector<Tensor>& in) { return lora_add(linear(in[0], in[3]), in[1], in[2], 1.5); },
                   {0, 1, 2, 3}});
  for (const Case& c : cases) check_each_input_alone(c);
}

}  // namespace
}  // namespace loom
