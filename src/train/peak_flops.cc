// The GPUs' rated peaks, for MFU (peak_flops.h).
#include "train/peak_flops.h"

#include <cctype>
#include <set>
#include <string>

#include "loom/core/device_runtime.h"
#include "loom/train/trainer.h"

namespace loom::train {

namespace {

// The name's words, split at spaces and dashes, upper-cased: "NVIDIA A100-SXM4-80GB" -> NVIDIA, A100, SXM4, 80GB.
std::set<std::string> name_words(const std::string& name) {
  std::set<std::string> words;
  std::string word;
  for (char c : name + " ") {
    if (c == ' ' || c == '-') {
      if (!word.empty()) words.insert(word);
      word.clear();
    } else {
      word += char(std::toupper(static_cast<unsigned char>(c)));
    }
  }
  return words;
}

}  // namespace

// NVIDIA's data-sheet figures, dense (without sparsity), bf16 inputs with f32 accumulation.
double known_bf16_peak_tflops(const std::string& gpu_name) {
  const std::set<std::string> w = name_words(gpu_name);
  auto has = [&](const char* word) { return w.count(word) > 0; };
  if (has("H100")) return has("PCIE") ? 756 : has("NVL") ? 835 : 989;  // SXM (e.g. "H100 80GB HBM3"), PCIe, NVL
  if (has("H200") || has("GH200")) return has("NVL") ? 835 : 989;
  if (has("A100")) return 312;                                          // SXM4 and PCIe alike
  if (has("L40S")) return 362;
  if (has("L40")) return 181;
  if (has("L4")) return 121;
  if (has("A10")) return 125;
  if (has("A40")) return 150;
  if (has("RTX") && has("4090")) return 165;
  return 0;
}

// The peak for MFU of the device the trainer runs on: a GPU in the table above, else none (MFU not shown).
double known_peak_flops(Device d) {
  if (!d.is_cuda()) return 0;
  return known_bf16_peak_tflops(device_runtime(d.type).describe(d.index)) * 1e12;
}

}  // namespace loom::train
