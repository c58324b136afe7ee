// A call's arguments (in generic form) copied to a device with their layouts kept: for shadow mode's second kernel
// (on the call's device), autotune's timing runs and CPU fallback (on host copies). The memory each tensor spans
// moves with the runtimes' raw copies, never with a kernel, so a device without even a copy kernel can fall back.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "loom/core/op_schema.h"
#include "loom/core/tensor.h"

namespace loom::dispatch {

class ArgumentCopies {
 public:
  // Copies every tensor of `args` that lives on `from` to `to` (outputs too, with their content: in-place and
  // accumulating kernels read it); a tensor on another device (a CPU scalar beside device tensors) is shared, and an
  // output there gets a copy on its own device.
  ArgumentCopies(const OpSchema& schema, const CallArgs& args, Device from, Device to);
  const CallArgs& args() const { return copies_; }
  void write_back() const;  // the outputs' memory back to the originals
  // (original, copy) for every output tensor present: after the call ran on both, what shadow mode compares.
  std::vector<std::pair<Tensor, Tensor>> outputs() const;
  std::vector<std::string> input_descriptions() const;

 private:
  const OpSchema& schema_;
  const CallArgs& originals_;
  CallArgs copies_;
  std::vector<Tensor> flats_;  // per slot (outputs): the copied span, for write_back
};

}  // namespace loom::dispatch
