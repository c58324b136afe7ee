// A tiny GPT-2 or LLaMA trained for three AdamW steps on fixed tokens: the losses a routing test compares between
// providers.
#pragma once

#include <string>
#include <vector>

#include "loom/nn/model.h"
#include "loom/optim/optimizer.h"
#include "test_util.h"

namespace loom::test {

// model: "gpt2-tiny" or "llama3-tiny". training_loss: the loss through forward_loss, the path loom-train takes (the
// classifier fused with the loss, linear_cross_entropy); otherwise the model's logits, then its loss.
inline std::vector<double> train_tiny_three_steps(const std::string& model_name, Device device = Device(),
                                                  bool training_loss = false) {
  nn::ModelConfig cfg = nn::ModelConfig::from_name(model_name);
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
    Tensor loss = training_loss ? model->forward_loss(x, y) : model->loss(model->forward(x), y);
    losses.push_back(loss.item<double>());
    loss.backward();
    opt.step();
  }
  return losses;
}

inline std::vector<double> train_tiny_gpt2_three_steps(Device device = Device()) {
  return train_tiny_three_steps("gpt2-tiny", device);
}

}  // namespace loom::test
