// How a model family splits under the parallel dimensions, declared beside its definition (src/nn/models.cc) from
// its config alone, and applied by loom::distributed's plan (loom/distributed/parallel_plan.h). nn only states the
// rules: it knows nothing of process groups.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace loom::nn {

struct ModelConfig;

// How one parameter splits across the ranks of a tensor-parallel group: rank r takes piece r of every block.
struct TensorParallelRule {
  enum class Style {
    kColumnwise,  // a linear layer whose output features split: its weight's rows, and its bias
    kRowwise,     // a linear layer whose input features split: its weight's columns (its bias stays whole)
    kVocabulary,  // an embedding or classifier whose vocabulary rows split
  };
  std::string parameter;  // the parameter's name, "*" standing for any block index ("h.*.attn.c_attn.weight")
  Style style = Style::kColumnwise;
  std::vector<int64_t> blocks;  // the full sizes along the split dimension, each split on its own (fused q, k, v)
  int64_t dim() const { return style == Style::kRowwise ? 1 : 0; }
  // Whether `name` is a parameter this rule names.
  bool matches(const std::string& name) const;
};

struct ParallelRules {
  // Tensor parallelism: the parameters that split (every other one stays whole on every rank), and the sizes that
  // must divide by the group's size, with why.
  std::vector<TensorParallelRule> tensor;
  struct Divisor {
    std::string name;
    int64_t value = 0;
    std::string why;
  };
  std::vector<Divisor> tensor_divisors;
  // Expert parallelism: experts per mixture-of-experts layer (0: a dense model, nothing to split), and the stacked
  // expert weights whose first dimension is the expert ("*" standing for the block index).
  int64_t experts = 0;
  std::vector<std::string> expert_parameters;
  // Context parallelism: whether the attention can run over a sequence split across ranks.
  bool attention_splits_sequence = false;
  // The transformer blocks' module names, "*" standing for the index ("h.*"): what ZeRO-2/3 wraps and the pipeline
  // places, block by block.
  std::string blocks;
};

// The rules of `cfg`'s family.
ParallelRules parallel_rules(const ModelConfig& cfg);

}  // namespace loom::nn
