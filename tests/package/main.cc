// A program outside the Loom tree that finds Loom with find_package and trains nothing: the README example.
#include <loom/functional.h>
#include <iostream>
int main() {
  using namespace loom;
  Tensor a = randn({4, 8}).set_requires_grad(true);
  Tensor b = randn({8, 3});
  Tensor loss = sum(matmul(a, b));
  loss.backward();
  std::cout << a.grad().shape()[0] << "x" << a.grad().shape()[1] << "\n";
}
