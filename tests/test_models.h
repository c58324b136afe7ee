// A tiny GPT-2 trained for three AdamW steps on fixed tokens: the losses a routing test compares between providers.
#pragma once

#include <vector>

#include "loom/nn/model.h"
#include "loom/optim/optimizer.h"
#include "test_util.h"

namespace loom::test {

inline std::vector<double> train_tiny_gpt2_three_steps(Device device = Device()) {
  nn::ModelConfig cfg = nn::ModelConfig::from_name("gpt2-tiny");
  cfg.vocab_size = cfg.padded_vocab_size = 128;
  cfg.max_seq_len = 16;
  auto model = nn::make_model(cfg);
  model->init_weights(1234);
  model->to(device);
  optim::AdamWOptions o;
  o.lr = 1e-2;
  optim::AdamW opt(model->parameters(), o);
  Tensor x = random_indices({2, 16}, 0, 128, kI64, 7).to(device);
  Tensor y = random_indices({2, 16}, 0, 128, kI64, 8).to(device);
  std::vector<double> losses;
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    Tensor loss = model->loss(model->forward(x), y);
    losses.push_back(loss.item<double>());
    loss.backward();
    opt.step();
  }
  return losses;
}

}  // namespace loom::test
