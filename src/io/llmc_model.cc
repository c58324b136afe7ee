// llm.c GPT-2 model files: header parsing and validation, and the parameter order of llm.c's
// fill_in_parameter_sizes (each per-layer tensor stored as one [L, ...] block, layer after layer).
#include "loom/io/input_guard.h"
#include "loom/io/llmc_model.h"

#include <bit>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>

#include "loom/autograd/grad_mode.h"
#include "loom/common/error.h"
#include "loom/io/atomic_file.h"

namespace loom::io {
namespace {

static_assert(std::endian::native == std::endian::little, "llm.c model files are little-endian");

// One llm.c parameter tensor and the Loom parameter it maps to ({} stands for the layer index when per_layer).
struct LlmcTensor {
  const char* llmc_name;
  const char* loom_name;
  bool per_layer;
};

// llm.c's order (ParameterTensors in train_gpt2.c). Shapes are checked against the model's parameters, which
// carry the layout llm.c uses (Linear weights [out, in], like qkvw [3C, C]).
constexpr LlmcTensor kLlmcTensors[] = {
    {"wte", "wte.weight", false},
    {"wpe", "wpe.weight", false},
    {"ln1w", "h.{}.ln_1.weight", true},
    {"ln1b", "h.{}.ln_1.bias", true},
    {"qkvw", "h.{}.attn.c_attn.weight", true},
    {"qkvb", "h.{}.attn.c_attn.bias", true},
    {"attprojw", "h.{}.attn.c_proj.weight", true},
    {"attprojb", "h.{}.attn.c_proj.bias", true},
    {"ln2w", "h.{}.ln_2.weight", true},
    {"ln2b", "h.{}.ln_2.bias", true},
    {"fcw", "h.{}.mlp.c_fc.weight", true},
    {"fcb", "h.{}.mlp.c_fc.bias", true},
    {"fcprojw", "h.{}.mlp.c_proj.weight", true},
    {"fcprojb", "h.{}.mlp.c_proj.bias", true},
    {"lnfw", "ln_f.weight", false},
    {"lnfb", "ln_f.bias", false},
};

std::string layer_name(const char* pattern, int64_t layer) {
  const std::string s = pattern;
  const size_t at = s.find("{}");
  return at == std::string::npos ? s : s.substr(0, at) + std::to_string(layer) + s.substr(at + 2);
}

// Shape of one layer's slice of tensor `t` (index into kLlmcTensors) in a file with header h.
Shape llmc_shape(size_t t, const LlmcModelHeader& h) {
  const int64_t C = h.channels;
  switch (t) {
    case 0: return {h.padded_vocab_size, C};
    case 1: return {h.max_seq_len, C};
    case 4: return {3 * C, C};
    case 5: return {3 * C};
    case 6: return {C, C};
    case 10: return {4 * C, C};
    case 11: return {4 * C};
    case 12: return {C, 4 * C};
    default: return {C};  // layer norms and the C-sized biases
  }
}

std::map<std::string, Tensor> gpt2_parameters(const nn::LanguageModel& model, const std::string& what) {
  LOOM_REQUIRE(model.config().family == nn::ModelFamily::kGPT2, what,
               ": llm.c model files hold GPT-2 models only; this model is ", model.config().describe());
  std::map<std::string, Tensor> params;
  for (auto& [name, p] : model.named_parameters()) params.emplace(name, p);
  return params;
}

const Tensor& find_parameter(const std::map<std::string, Tensor>& params, const std::string& name,
                             const std::string& what) {
  auto it = params.find(name);
  LOOM_REQUIRE(it != params.end(), what, ": the model has no parameter '", name, "' (not a Loom GPT-2?)");
  return it->second;
}

LlmcModelHeader header_from_config(const nn::ModelConfig& c, DType dtype) {
  LlmcModelHeader h;
  h.version = dtype == kBF16 ? kLlmcVersionBF16 : kLlmcVersionF32;
  h.max_seq_len = c.max_seq_len;
  h.vocab_size = c.vocab_size;
  h.num_layers = c.n_layer;
  h.num_heads = c.n_head;
  h.channels = c.n_embd;
  h.padded_vocab_size = c.padded_vocab_size;
  return h;
}

}  // namespace

int64_t LlmcModelHeader::num_parameters() const {
  // In 128 bits: a header's 32-bit sizes multiply past int64 (a corrupt header then passed the size check).
  const __int128 C = channels, L = num_layers;
  const __int128 n = __int128(padded_vocab_size) * C + __int128(max_seq_len) * C + L * (12 * C * C + 13 * C) + 2 * C;
  LOOM_REQUIRE(n >= 0 && n <= __int128(INT64_MAX / 16), "llm.c model: the header's sizes (channels ", channels,
               ", layers ", num_layers, ", padded vocabulary ", padded_vocab_size, ") describe more parameters than a ",
               "file can hold");
  return int64_t(n);
}

bool is_llmc_model_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  int32_t magic = 0;
  if (!in.read(reinterpret_cast<char*>(&magic), sizeof magic)) return false;
  return magic == kLlmcModelMagic;
}

LlmcModelHeader read_llmc_header(const std::string& path) {
  std::error_code ec;
  LOOM_REQUIRE(std::filesystem::is_regular_file(path, ec), "llm.c model: file '", path, "' does not exist");
  const uint64_t file_size = std::filesystem::file_size(path, ec);
  LOOM_REQUIRE(!ec, "llm.c model: cannot get the size of '", path, "': ", ec.message());
  std::ifstream in(path, std::ios::binary);
  LOOM_REQUIRE(in, "llm.c model: cannot open '", path, "'");
  LOOM_REQUIRE(file_size >= uint64_t(kLlmcHeaderBytes), "llm.c model: '", path, "' is truncated: ", file_size,
               " bytes, shorter than the ", kLlmcHeaderBytes, "-byte header");
  int32_t raw[kLlmcHeaderInts];
  LOOM_REQUIRE(in.read(reinterpret_cast<char*>(raw), sizeof raw), "llm.c model: cannot read the header of '", path,
               "'");
  LOOM_REQUIRE(raw[0] == kLlmcModelMagic, "llm.c model: '", path, "' has bad magic ", raw[0], " (expected ",
               kLlmcModelMagic, "; not an llm.c GPT-2 model file)");
  LOOM_REQUIRE(raw[1] == kLlmcVersionF32 || raw[1] == kLlmcVersionBF16, "llm.c model: '", path,
               "' has unsupported version ", raw[1], " (expected ", kLlmcVersionF32, " for f32 or ", kLlmcVersionBF16,
               " for bf16 parameters; older versions lack the padded vocabulary: re-export with llm.c's "
               "train_gpt2.py)");
  LlmcModelHeader h;
  h.version = raw[1];
  h.max_seq_len = raw[2];
  h.vocab_size = raw[3];
  h.num_layers = raw[4];
  h.num_heads = raw[5];
  h.channels = raw[6];
  h.padded_vocab_size = raw[7];
  LOOM_REQUIRE(h.max_seq_len > 0 && h.vocab_size > 0 && h.num_layers > 0 && h.num_heads > 0 && h.channels > 0 &&
                   h.padded_vocab_size >= h.vocab_size && h.channels % h.num_heads == 0,
               "llm.c model: '", path, "' has an inconsistent header: max_seq_len=", h.max_seq_len,
               " vocab_size=", h.vocab_size, " padded_vocab_size=", h.padded_vocab_size, " num_layers=", h.num_layers,
               " num_heads=", h.num_heads, " channels=", h.channels);
  const uint64_t expected = uint64_t(kLlmcHeaderBytes) + uint64_t(h.num_parameters()) * dtype_size(h.dtype());
  LOOM_REQUIRE(file_size >= expected, "llm.c model: '", path, "' is truncated: ", file_size, " bytes, expected ",
               expected, " (header + ", h.num_parameters(), " ", dtype_name(h.dtype()), " parameters)");
  LOOM_REQUIRE(file_size == expected, "llm.c model: '", path, "' has ", file_size - expected,
               " unexpected bytes after its ", h.num_parameters(), " ", dtype_name(h.dtype()),
               " parameters (corrupt, or its header does not match its contents)");
  return h;
}

nn::ModelConfig llmc_read_config(const std::string& path) {
  LlmcModelHeader h = read_llmc_header(path);
  nn::ModelConfig c;  // defaults are GPT-2's: layer norm eps 1e-5, tied embeddings, no dropout
  c.family = nn::ModelFamily::kGPT2;
  c.vocab_size = h.vocab_size;
  c.padded_vocab_size = h.padded_vocab_size;
  c.max_seq_len = h.max_seq_len;
  c.n_layer = h.num_layers;
  c.n_head = c.n_kv_head = h.num_heads;
  c.n_embd = h.channels;
  c.ffn_hidden = 4 * h.channels;
  c.tie_embeddings = true;
  c.dropout = 0.0;
  return c;
}

void load_llmc_model(const std::string& path, nn::LanguageModel& model) {
  note_input(path);
  autograd::NoGradGuard no_grad;
  const std::string what = "llm.c model '" + path + "'";
  LlmcModelHeader h = read_llmc_header(path);
  auto params = gpt2_parameters(model, what);
  const nn::ModelConfig& c = model.config();
  LOOM_REQUIRE(c.n_layer == h.num_layers && c.n_head == h.num_heads && c.n_kv_head == c.n_head &&
                   c.n_embd == h.channels && c.max_seq_len == h.max_seq_len && c.vocab_size == h.vocab_size &&
                   c.ffn_hidden == 4 * c.n_embd,
               what, " does not match the model: the file has ", llmc_read_config(path).describe(),
               "; the model is ", c.describe(),
               c.ffn_hidden != 4 * c.n_embd ? " with a non-4C MLP" : "");

  std::ifstream in(path, std::ios::binary);
  LOOM_REQUIRE(in, "llm.c model: cannot open '", path, "'");
  in.seekg(kLlmcHeaderBytes);
  const DType file_dtype = h.dtype();
  for (size_t t = 0; t < std::size(kLlmcTensors); ++t) {
    const LlmcTensor& spec = kLlmcTensors[t];
    const Shape shape = llmc_shape(t, h);
    for (int64_t layer = 0; layer < (spec.per_layer ? h.num_layers : 1); ++layer) {
      const std::string name = layer_name(spec.loom_name, layer);
      Tensor dst = find_parameter(params, name, what);
      Tensor buf = empty(shape, file_dtype);
      LOOM_REQUIRE(in.read(static_cast<char*>(buf.data()), std::streamsize(buf.nbytes())), "llm.c model: '", path,
                   "' ended while reading ", spec.llmc_name, " (", name, ")");
      if (t == 0 && shape != dst.shape()) {
        // A different vocabulary padding: the real rows carry over, padding rows are zero (as llm.c pads).
        LOOM_REQUIRE(dst.dim() == 2 && dst.size(1) == h.channels && dst.size(0) >= h.vocab_size, what,
                     ": wte is ", shape_str(shape), ", the model's wte.weight is ", shape_str(dst.shape()));
        dst.copy_from(zeros(dst.shape(), dst.dtype(), dst.device()));
        dst.narrow(0, 0, h.vocab_size).copy_from(buf.narrow(0, 0, h.vocab_size));
        continue;
      }
      LOOM_REQUIRE(shape == dst.shape(), what, ": ", spec.llmc_name, " of layer ", layer, " is ", shape_str(shape),
                   ", the model's ", name, " is ", shape_str(dst.shape()));
      dst.copy_from(buf);
    }
  }
}

void save_llmc_model(const std::string& path, const nn::LanguageModel& model, DType dtype) {
  autograd::NoGradGuard no_grad;
  const std::string what = "llm.c model '" + path + "'";
  LOOM_REQUIRE(dtype == kF32 || dtype == kBF16, what, ": dtype must be f32 or bf16, got ", dtype_name(dtype));
  auto params = gpt2_parameters(model, what);
  const nn::ModelConfig& c = model.config();
  LOOM_REQUIRE(c.n_kv_head == c.n_head && c.ffn_hidden == 4 * c.n_embd, what,
               ": llm.c's GPT-2 needs n_kv_head == n_head and a 4C MLP; the model is ", c.describe(), ", ffn ",
               c.ffn_hidden);
  const LlmcModelHeader h = header_from_config(c, dtype);
  const int64_t int32_max = std::numeric_limits<int32_t>::max();
  LOOM_REQUIRE(h.max_seq_len <= int32_max && h.padded_vocab_size <= int32_max && h.num_layers <= int32_max &&
                   h.channels <= int32_max && h.num_heads <= int32_max,
               what, ": the config does not fit the int32 header: ", c.describe());

  int32_t raw[kLlmcHeaderInts] = {};
  raw[0] = kLlmcModelMagic;
  raw[1] = h.version;
  raw[2] = int32_t(h.max_seq_len);
  raw[3] = int32_t(h.vocab_size);
  raw[4] = int32_t(h.num_layers);
  raw[5] = int32_t(h.num_heads);
  raw[6] = int32_t(h.channels);
  raw[7] = int32_t(h.padded_vocab_size);

  AtomicFileWriter out(path);
  out.write(raw, sizeof raw);
  for (size_t t = 0; t < std::size(kLlmcTensors); ++t) {
    const LlmcTensor& spec = kLlmcTensors[t];
    const Shape shape = llmc_shape(t, h);
    for (int64_t layer = 0; layer < (spec.per_layer ? h.num_layers : 1); ++layer) {
      const std::string name = layer_name(spec.loom_name, layer);
      const Tensor& p = find_parameter(params, name, what);
      LOOM_REQUIRE(p.shape() == shape, what, ": the model's ", name, " is ", shape_str(p.shape()), ", llm.c's ",
                   spec.llmc_name, " needs ", shape_str(shape));
      Tensor host = p.detach().to(Device()).to(dtype).contiguous();
      out.write(host.data(), host.nbytes());
    }
  }
  out.commit();
}

}  // namespace loom::io
