// loom.nn, loom.models and loom.optim: modules, language models, their Hugging Face and Loom checkpoints, AdamW and
// SGD, the learning-rate schedules, generation and the tokenizers.
#include <filesystem>

#include "bindings.h"
#include "loom/autograd/grad_mode.h"
#include "loom/data/gpt2_tokenizer.h"
#include "loom/data/tokenizer.h"
#include "loom/io/hf_model_dir.h"
#include "loom/io/safetensors.h"
#include "loom/nn/layers.h"
#include "loom/nn/model.h"
#include "loom/nn/module.h"
#include "loom/optim/clip_grad.h"
#include "loom/optim/lr_schedule.h"
#include "loom/optim/optimizer.h"
#include "loom/train/checkpoint.h"

namespace loom::python {

namespace {

using ModulePtr = std::shared_ptr<nn::Module>;

py::dict state_dict(const nn::Module& m) {
  py::dict out;
  for (const auto& [name, t] : m.named_parameters()) out[py::str(name)] = t;
  for (const auto& [name, t] : m.named_buffers()) out[py::str(name)] = t;
  return out;
}

// Copies each tensor of `state` into the module's parameter or buffer of that name (shapes checked; every name must
// be the module's, and with strict every parameter and buffer must be given).
void load_state_dict(nn::Module& m, const std::map<std::string, Tensor>& state, bool strict) {
  std::map<std::string, Tensor> mine;
  for (const auto& [name, t] : m.named_parameters()) mine[name] = t;
  for (const auto& [name, t] : m.named_buffers()) mine[name] = t;
  for (const auto& [name, t] : state) {
    LOOM_REQUIRE(mine.count(name), "load_state_dict: '", name, "' is no parameter or buffer of the module");
    LOOM_REQUIRE(mine.at(name).shape() == t.shape(), "load_state_dict: '", name, "' has shape ", shape_str(t.shape()),
                 ", the module's ", shape_str(mine.at(name).shape()));
  }
  if (strict)
    for (const auto& [name, t] : mine) LOOM_REQUIRE(state.count(name), "load_state_dict: '", name, "' is missing");
  autograd::NoGradGuard no_grad;
  for (const auto& [name, t] : state) mine.at(name).copy_from(t);
}

// The optimizer's parameter groups from a list of tensors or of {"params": [...], "weight_decay": w} dicts.
std::vector<optim::ParamGroup> param_groups(const py::iterable& params, double weight_decay) {
  std::vector<optim::ParamGroup> groups;
  optim::ParamGroup plain{{}, weight_decay};
  for (const py::handle& item : params) {
    if (py::isinstance<py::dict>(item)) {
      const py::dict d = item.cast<py::dict>();
      LOOM_REQUIRE(d.contains("params"), "optimizer: a parameter group needs 'params'");
      optim::ParamGroup g{d["params"].cast<std::vector<Tensor>>(),
                          d.contains("weight_decay") ? d["weight_decay"].cast<double>() : weight_decay};
      groups.push_back(std::move(g));
    } else {
      plain.params.push_back(item.cast<Tensor>());
    }
  }
  if (!plain.params.empty()) groups.insert(groups.begin(), std::move(plain));
  LOOM_REQUIRE(!groups.empty(), "optimizer: no parameters given");
  return groups;
}

py::dict optimizer_state(const optim::Optimizer& o) {
  py::dict out;
  for (const auto& [name, t] : o.state_dict()) out[py::str(name)] = t;
  return out;
}

// A model config from a name (ModelConfig::from_name) or a config object, with fields overridden by keyword.
nn::ModelConfig config_of(const py::object& name_or_config, const py::kwargs& overrides) {
  nn::ModelConfig cfg = py::isinstance<nn::ModelConfig>(name_or_config)
                            ? name_or_config.cast<nn::ModelConfig>()
                            : nn::ModelConfig::from_name(name_or_config.cast<std::string>());
  py::object c = py::cast(cfg);
  for (const auto& [k, v] : overrides) {
    const std::string key = k.cast<std::string>();
    LOOM_REQUIRE(py::hasattr(c, key.c_str()) && key != "from_name" && key != "from_json",
                 "model config: unknown field '", key, "'");
    c.attr(key.c_str()) = v;
  }
  cfg = c.cast<nn::ModelConfig>();
  if (overrides.contains("vocab_size") && !overrides.contains("padded_vocab_size"))
    cfg.padded_vocab_size = nn::round_up_vocab(cfg.vocab_size);
  return cfg;
}

std::shared_ptr<nn::LanguageModel> make(const nn::ModelConfig& cfg, const py::object& seed, const py::object& device) {
  std::optional<uint64_t> s;
  if (!seed.is_none()) s = seed.cast<uint64_t>();
  std::shared_ptr<nn::LanguageModel> model;
  {
    py::gil_scoped_release release;
    model = nn::make_model(cfg, s);
  }
  if (!device.is_none()) model->to(to_device(device));
  return model;
}

std::vector<int32_t> tokens_of(const py::object& prompt, const data::Tokenizer* tokenizer) {
  if (py::isinstance<py::str>(prompt)) {
    LOOM_REQUIRE(tokenizer, "generate: a text prompt needs a tokenizer (or give token ids)");
    return data::encode_prompt(*tokenizer, prompt.cast<std::string>());
  }
  if (py::isinstance<Tensor>(prompt)) return to_vector<int32_t>(prompt.cast<Tensor>().to(kI32).reshape({-1}));
  return prompt.cast<std::vector<int32_t>>();
}

}  // namespace

void bind_nn(py::module_& m) {
  py::module_ nn_m = m.def_submodule("nn", "Loom's modules (loom/nn/layers.h)");
  py::class_<nn::Module, ModulePtr>(nn_m, "Module",
                                    "A module's parameters, buffers and submodules. Subclass it in Python: register "
                                    "parameters, buffers and submodules in __init__ and define forward")
      .def(py::init<>())
      .def("register_parameter", [](nn::Module& self, const std::string& name, const Tensor& t, bool requires_grad) {
        return self.register_parameter(name, t, requires_grad);
      }, py::arg("name"), py::arg("tensor"), py::arg("requires_grad") = true,
           "adds a parameter (requires_grad set) and returns it")
      .def("register_buffer", &nn::Module::register_buffer, py::arg("name"), py::arg("tensor"))
      .def("register_module", [](nn::Module& self, const std::string& name, const ModulePtr& child) {
        return self.register_module(name, child);
      }, py::arg("name"), py::arg("module"), "adds a submodule (its parameters under name.) and returns it")
      .def("__call__", [](const py::object& self, const py::args& args, const py::kwargs& kwargs) {
        return self.attr("forward")(*args, **kwargs);
      })
      .def("parameters", &nn::Module::parameters)
      .def("named_parameters", &nn::Module::named_parameters)
      .def("named_buffers", &nn::Module::named_buffers)
      .def("named_modules", &nn::Module::named_modules)
      .def("num_parameters", &nn::Module::num_parameters)
      .def("train", [](nn::Module& self, bool on) -> nn::Module& {
        self.train(on);
        return self;
      }, py::arg("mode") = true, py::return_value_policy::reference_internal)
      .def("eval", [](nn::Module& self) -> nn::Module& {
        self.eval();
        return self;
      }, py::return_value_policy::reference_internal)
      .def_property_readonly("training", &nn::Module::is_training)
      .def("to", [](nn::Module& self, const py::object& target) -> nn::Module& {
        if (py::isinstance<DType>(target)) {
          self.to(target.cast<DType>());
        } else {
          try {
            self.to(to_device(target));
          } catch (const Error&) {
            self.to(to_dtype(target));
          }
        }
        return self;
      }, py::arg("device_or_dtype"), py::return_value_policy::reference_internal)
      .def("zero_grad", &nn::Module::zero_grad)
      .def("state_dict", &state_dict, "every parameter and buffer by name (the live tensors)")
      .def("load_state_dict", &load_state_dict, py::arg("state"), py::arg("strict") = true,
           "copies the tensors in, names and shapes checked");

  py::class_<nn::Linear, nn::Module, std::shared_ptr<nn::Linear>>(nn_m, "Linear")
      .def(py::init<int64_t, int64_t, bool>(), py::arg("in_features"), py::arg("out_features"), py::arg("bias") = true)
      .def_readwrite("weight", &nn::Linear::weight)
      .def_property("bias", [](const nn::Linear& l) -> py::object {
        return l.bias.defined() ? py::cast(l.bias) : py::none();
      }, [](nn::Linear& l, const std::optional<Tensor>& b) { l.bias = b.value_or(Tensor()); })
      .def("forward", &nn::Linear::forward)
      .def("__call__", &nn::Linear::forward);
  py::class_<nn::Embedding, nn::Module, std::shared_ptr<nn::Embedding>>(nn_m, "Embedding")
      .def(py::init<int64_t, int64_t>(), py::arg("num_embeddings"), py::arg("dim"))
      .def_readwrite("weight", &nn::Embedding::weight)
      .def("forward", &nn::Embedding::forward)
      .def("__call__", &nn::Embedding::forward);
  py::class_<nn::LayerNorm, nn::Module, std::shared_ptr<nn::LayerNorm>>(nn_m, "LayerNorm")
      .def(py::init<int64_t, double, bool>(), py::arg("dim"), py::arg("eps") = 1e-5, py::arg("bias") = true)
      .def_readwrite("weight", &nn::LayerNorm::weight)
      .def_readwrite("bias", &nn::LayerNorm::bias)
      .def_readonly("eps", &nn::LayerNorm::eps)
      .def("forward", &nn::LayerNorm::forward)
      .def("__call__", &nn::LayerNorm::forward);
  py::class_<nn::RMSNorm, nn::Module, std::shared_ptr<nn::RMSNorm>>(nn_m, "RMSNorm")
      .def(py::init<int64_t, double>(), py::arg("dim"), py::arg("eps") = 1e-6)
      .def_readwrite("weight", &nn::RMSNorm::weight)
      .def_readonly("eps", &nn::RMSNorm::eps)
      .def("forward", &nn::RMSNorm::forward)
      .def("__call__", &nn::RMSNorm::forward);
  py::class_<nn::Dropout, nn::Module, std::shared_ptr<nn::Dropout>>(nn_m, "Dropout")
      .def(py::init<double>(), py::arg("p"))
      .def_readonly("p", &nn::Dropout::p)
      .def("forward", [](const nn::Dropout& d, const Tensor& x) { return d.forward(x); })
      .def("__call__", [](const nn::Dropout& d, const Tensor& x) { return d.forward(x); });
  py::class_<nn::GeluMLP, nn::Module, std::shared_ptr<nn::GeluMLP>>(nn_m, "GeluMLP")
      .def(py::init<int64_t, int64_t>(), py::arg("dim"), py::arg("hidden"))
      .def_readonly("c_fc", &nn::GeluMLP::c_fc)
      .def_readonly("c_proj", &nn::GeluMLP::c_proj)
      .def("forward", &nn::GeluMLP::forward)
      .def("__call__", &nn::GeluMLP::forward);
  py::class_<nn::SwiGLUMLP, nn::Module, std::shared_ptr<nn::SwiGLUMLP>>(nn_m, "SwiGLUMLP")
      .def(py::init<int64_t, int64_t>(), py::arg("dim"), py::arg("hidden"))
      .def("forward", &nn::SwiGLUMLP::forward)
      .def("__call__", &nn::SwiGLUMLP::forward);
  nn_m.def("clip_grad_norm_", [](const std::vector<Tensor>& params, double max_norm) {
    return optim::clip_grad_norm(params, max_norm);
  }, py::arg("parameters"), py::arg("max_norm"), "scales the gradients to a global norm of at most max_norm; "
        "returns the norm before clipping");

  // ---- models ----
  py::module_ models = m.def_submodule("models", "GPT-2 and LLaMA-3 language models (loom/nn/model.h)");
  py::enum_<nn::ModelFamily>(models, "Family").value("gpt2", nn::ModelFamily::kGPT2).value("llama", nn::ModelFamily::kLlama);
  py::class_<nn::ModelConfig>(models, "ModelConfig", "A model's sizes (docs/TRAINING.md lists the keys)")
      .def(py::init<>())
      .def_static("from_name", &nn::ModelConfig::from_name, py::arg("name_or_path"))
      .def_static("from_json", &nn::ModelConfig::from_json, py::arg("json_text"))
      .def("to_json", &nn::ModelConfig::to_json)
      .def("to_hf_json", [](const nn::ModelConfig& c, const py::object& dt) { return c.to_hf_json(to_dtype(dt)); },
           py::arg("dtype") = "f32")
      .def("describe", &nn::ModelConfig::describe)
      .def_readwrite("family", &nn::ModelConfig::family)
      .def_readwrite("vocab_size", &nn::ModelConfig::vocab_size)
      .def_readwrite("padded_vocab_size", &nn::ModelConfig::padded_vocab_size)
      .def_readwrite("max_seq_len", &nn::ModelConfig::max_seq_len)
      .def_readwrite("n_layer", &nn::ModelConfig::n_layer)
      .def_readwrite("n_head", &nn::ModelConfig::n_head)
      .def_readwrite("n_kv_head", &nn::ModelConfig::n_kv_head)
      .def_readwrite("n_embd", &nn::ModelConfig::n_embd)
      .def_readwrite("ffn_hidden", &nn::ModelConfig::ffn_hidden)
      .def_readwrite("head_dim", &nn::ModelConfig::head_dim)
      .def_readwrite("norm_eps", &nn::ModelConfig::norm_eps)
      .def_readwrite("rope_theta", &nn::ModelConfig::rope_theta)
      .def_readwrite("tie_embeddings", &nn::ModelConfig::tie_embeddings)
      .def_readwrite("dropout", &nn::ModelConfig::dropout)
      .def("__repr__", &nn::ModelConfig::describe);

  py::class_<nn::LanguageModel, nn::Module, std::shared_ptr<nn::LanguageModel>>(models, "LanguageModel")
      .def_property_readonly("config", &nn::LanguageModel::config)
      .def("forward", [](nn::LanguageModel& self, const Tensor& idx) {
        py::gil_scoped_release release;
        return self.forward(idx);
      }, py::arg("idx"), "token ids [B, T] -> logits [B, T, padded_vocab_size]")
      .def("__call__", [](nn::LanguageModel& self, const Tensor& idx) {
        py::gil_scoped_release release;
        return self.forward(idx);
      }, py::arg("idx"))
      .def("loss", [](const nn::LanguageModel& self, const Tensor& logits, const Tensor& targets) {
        return self.loss(logits, targets);
      }, py::arg("logits"), py::arg("targets"), "mean cross-entropy over the real vocabulary")
      .def("forward_loss", [](nn::LanguageModel& self, const Tensor& idx, const Tensor& targets) {
        py::gil_scoped_release release;
        return self.forward_loss(idx, targets);
      }, py::arg("idx"), py::arg("targets"), "loss(forward(idx), targets) without the whole logits in memory")
      .def("hf_state_dict", &nn::LanguageModel::hf_state_dict, "the parameters by Hugging Face's names and layouts")
      .def("save_pretrained", [](const nn::LanguageModel& self, const std::string& dir, const py::object& dtype,
                                 bool force, const std::string& gpt2_vocab_dir) {
        io::HfExportOptions o;
        o.dtype = to_dtype(dtype);
        o.force = force;
        o.gpt2_vocab_dir = gpt2_vocab_dir;
        py::gil_scoped_release release;
        return io::save_hf_model_dir(dir, self, o).files;
      }, py::arg("dir"), py::arg("dtype") = "f32", py::arg("force") = false, py::arg("gpt2_vocab_dir") = "",
           "writes a Hugging Face model directory (config.json, model.safetensors, GPT-2's tokenizer files when its "
           "vocabulary is found); returns the files written");

  models.def("make", [](const py::object& name, const py::object& seed, const py::object& device,
                        const py::kwargs& overrides) { return make(config_of(name, overrides), seed, device); },
             py::arg("name_or_config"), py::kw_only(), py::arg("seed") = py::none(), py::arg("device") = py::none(),
             "a model by name (gpt2, gpt2-medium, d4, llama3-1b, gpt2-tiny, a JSON config, a HF directory) or "
             "config, its fields overridden by keyword (n_layer=4, ...), initialized from `seed`");
  models.def("gpt2", [](const std::string& size, const py::object& seed, const py::object& device,
                        const py::kwargs& overrides) {
    const std::string name = size.rfind("gpt2", 0) == 0 || size.rfind('d', 0) == 0 ? size : "gpt2-" + size;
    return make(config_of(py::str(name), overrides), seed, device);
  }, py::arg("size") = "124m", py::kw_only(), py::arg("seed") = py::none(), py::arg("device") = py::none(),
             "GPT-2: 124m, 350m, 774m, 1558m, tiny, or d<N>; fields overridden by keyword");
  models.def("llama3", [](const std::string& size, const py::object& seed, const py::object& device,
                          const py::kwargs& overrides) {
    const std::string name = size.rfind("llama3", 0) == 0 ? size : "llama3-" + size;
    return make(config_of(py::str(name), overrides), seed, device);
  }, py::arg("size") = "1b", py::kw_only(), py::arg("seed") = py::none(), py::arg("device") = py::none(),
             "LLaMA-3: 1b, 8b, tiny; fields overridden by keyword");

  // ---- checkpoints ----
  m.def("from_pretrained", [](const std::string& dir, const py::object& device) {
    std::shared_ptr<nn::LanguageModel> model;
    {
      py::gil_scoped_release release;
      model = io::load_hf_model(dir);
    }
    if (!device.is_none()) model->to(to_device(device));
    return model;
  }, py::arg("hf_dir"), py::kw_only(), py::arg("device") = py::none(),
        "a model from a Hugging Face directory (config.json and safetensors weights, GPT-2 or LLaMA)");
  m.def("load_model", [](const std::string& path, const py::object& device) {
    std::shared_ptr<nn::LanguageModel> model;
    {
      py::gil_scoped_release release;
      model = train::load_model_from(path, "load_model");
    }
    if (!device.is_none()) model->to(to_device(device));
    return model;
  }, py::arg("path"), py::kw_only(), py::arg("device") = py::none(),
        "a model as loom-generate reads one: a Loom checkpoint (file, step directory or a run's checkpoint "
        "directory), a Hugging Face directory or an llm.c model file");
  m.def("save_model", [](const nn::LanguageModel& model, const std::string& path) {
    py::gil_scoped_release release;
    io::save_model(path, model);
  }, py::arg("model"), py::arg("path"),
        "the model alone in Loom's format (weights and config in one safetensors file), which load_model, "
        "loom-generate, loom-export and loom-train --init-from read");
  m.def("save_safetensors", [](const std::string& path, const std::map<std::string, Tensor>& tensors,
                               const std::map<std::string, std::string>& metadata) {
    io::TensorMap host;
    for (const auto& [k, v] : tensors) host[k] = v.detach().to(Device()).contiguous();
    py::gil_scoped_release release;
    io::save_safetensors(path, host, metadata);
  }, py::arg("path"), py::arg("tensors"), py::arg("metadata") = std::map<std::string, std::string>{});
  m.def("load_safetensors", [](const std::string& path) {
    py::gil_scoped_release release;
    return io::load_safetensors(path);
  }, py::arg("path"), "every tensor of a safetensors file by name (on the CPU)");

  // ---- optimizers and schedules ----
  py::module_ optim_m = m.def_submodule("optim", "AdamW, SGD and the learning-rate schedules (loom/optim)");
  py::class_<optim::Optimizer>(optim_m, "Optimizer")
      .def("step", [](optim::Optimizer& o) {
        py::gil_scoped_release release;
        o.step();
      })
      .def("zero_grad", &optim::Optimizer::zero_grad)
      .def_property("lr", &optim::Optimizer::lr, &optim::Optimizer::set_lr)
      .def_property_readonly("step_count", &optim::Optimizer::step_count)
      .def("parameters", &optim::Optimizer::parameters)
      .def("state_dict", &optimizer_state, "the live state tensors by name (clone them for a snapshot)")
      .def("load_state_dict", [](optim::Optimizer& o, const optim::OptimizerState& s) { o.load_state_dict(s); },
           py::arg("state"));
  py::class_<optim::AdamW, optim::Optimizer>(optim_m, "AdamW")
      .def(py::init([](const py::iterable& params, double lr, std::pair<double, double> betas, double eps,
                       double weight_decay, bool flat) {
        optim::AdamWOptions o;
        o.lr = lr;
        o.beta1 = betas.first;
        o.beta2 = betas.second;
        o.eps = eps;
        o.weight_decay = weight_decay;
        o.flat = flat;
        return std::make_unique<optim::AdamW>(param_groups(params, weight_decay), o);
      }), py::arg("params"), py::arg("lr") = 1e-3, py::arg("betas") = std::make_pair(0.9, 0.999),
           py::arg("eps") = 1e-8, py::arg("weight_decay") = 1e-2, py::arg("flat") = true,
           "AdamW as PyTorch's; params: tensors, or groups {'params': [...], 'weight_decay': w}");
  py::class_<optim::SGD, optim::Optimizer>(optim_m, "SGD")
      .def(py::init([](const py::iterable& params, double lr, double momentum, double weight_decay, bool flat) {
        optim::SGDOptions o;
        o.lr = lr;
        o.momentum = momentum;
        o.weight_decay = weight_decay;
        o.flat = flat;
        return std::make_unique<optim::SGD>(param_groups(params, weight_decay), o);
      }), py::arg("params"), py::arg("lr") = 1e-2, py::arg("momentum") = 0.0, py::arg("weight_decay") = 0.0,
           py::arg("flat") = true);
  optim_m.def("param_groups", [](const nn::Module& model, double weight_decay) {
    py::list out;
    for (const optim::ParamGroup& g : optim::adamw_param_groups(model.named_parameters(), weight_decay)) {
      py::dict d;
      d["params"] = g.params;
      d["weight_decay"] = g.weight_decay;
      out.append(d);
    }
    return out;
  }, py::arg("model"), py::arg("weight_decay"), "nanoGPT's groups: matrices decay, biases and norms do not");
  py::class_<optim::LrSchedule>(optim_m, "LrSchedule", "linear warmup, then constant, cosine or linear decay")
      .def(py::init<const std::string&, double, int64_t, int64_t, double>(), py::arg("kind"), py::arg("max_lr"),
           py::arg("warmup_steps"), py::arg("total_steps"), py::arg("final_lr_fraction") = 0.0)
      .def("lr", &optim::LrSchedule::lr, py::arg("step"), "the rate of 0-based step `step`")
      .def("__call__", &optim::LrSchedule::lr, py::arg("step"))
      .def_property_readonly("kind", [](const optim::LrSchedule& s) { return lr_schedule_kind_name(s.kind()); })
      .def_property_readonly("max_lr", &optim::LrSchedule::max_lr)
      .def_property_readonly("min_lr", &optim::LrSchedule::min_lr)
      .def_property_readonly("warmup_steps", &optim::LrSchedule::warmup_steps)
      .def_property_readonly("total_steps", &optim::LrSchedule::total_steps);

  // ---- tokenizers and generation ----
  py::class_<data::Tokenizer, std::shared_ptr<data::Tokenizer>>(m, "Tokenizer",
                                                                 "GPT-2's, LLaMA-3's or a tokenizer.json's")
      .def_static("from_file", [](const std::string& path) {
        return std::shared_ptr<data::Tokenizer>(data::load_tokenizer("gpt2", path));
      }, py::arg("path"), "a Hugging Face tokenizer.json (byte-level BPE)")
      .def_static("gpt2", [](const std::string& vocab_dir) {
        return std::shared_ptr<data::Tokenizer>(std::make_shared<data::GPT2Tokenizer>(vocab_dir));
      }, py::arg("vocab_dir") = "", "GPT-2's (encoder.json and vocab.bpe: scripts/fetch_gpt2_vocab.sh)")
      .def_static("load", [](const std::string& name, const std::string& path) {
        return std::shared_ptr<data::Tokenizer>(data::load_tokenizer(name, path));
      }, py::arg("name"), py::arg("path") = "", "by name as loom-train's --tokenizer: gpt2 or llama3")
      .def_property_readonly("name", &data::Tokenizer::name)
      .def_property_readonly("vocab_size", &data::Tokenizer::vocab_size)
      .def("encode", [](const data::Tokenizer& t, const std::string& text) {
        py::gil_scoped_release release;
        return t.encode(text);
      }, py::arg("text"))
      .def("decode", [](const data::Tokenizer& t, const std::vector<int32_t>& ids) {
        return py::bytes(t.decode(ids)).attr("decode")("utf-8", "replace");
      }, py::arg("ids"))
      .def_property_readonly("end_tokens", &data::Tokenizer::end_tokens)
      .def_property_readonly("document_token", &data::Tokenizer::document_token);

  m.def("generate", [](nn::LanguageModel& model, const py::object& prompt, int64_t max_new_tokens,
                       double temperature, int64_t top_k, double top_p, uint64_t seed, double repetition_penalty,
                       const std::optional<std::vector<int32_t>>& stop_tokens,
                       const std::vector<std::string>& stop_strings, std::shared_ptr<data::Tokenizer> tokenizer,
                       bool use_kv_cache, const std::function<bool(int32_t)>& on_token) -> py::object {
    const bool text = py::isinstance<py::str>(prompt);
    if (text && !tokenizer)
      tokenizer = data::load_tokenizer(model.config().family == nn::ModelFamily::kLlama ? "llama3" : "gpt2");
    nn::GenerateOptions g;
    g.max_new_tokens = max_new_tokens;
    g.temperature = temperature;
    g.top_k = top_k;
    g.top_p = top_p;
    g.seed = seed;
    g.repetition_penalty = repetition_penalty;
    g.use_kv_cache = use_kv_cache;
    g.stop_strings = stop_strings;
    if (stop_tokens) g.stop_tokens = *stop_tokens;
    else if (tokenizer) g.stop_tokens = tokenizer->end_tokens();
    if (tokenizer) g.decode = [tokenizer](const std::vector<int32_t>& t) { return tokenizer->decode(t); };
    LOOM_REQUIRE(stop_strings.empty() || tokenizer, "generate: stop_strings need a tokenizer");
    if (on_token)
      g.on_token = [&on_token](int32_t t) {
        py::gil_scoped_acquire gil;
        return on_token(t);
      };
    const std::vector<int32_t> ids = tokens_of(prompt, tokenizer.get());
    std::vector<int32_t> out;
    {
      py::gil_scoped_release release;
      out = nn::generate(model, ids, g);
    }
    if (text) return py::bytes(tokenizer->decode(out)).attr("decode")("utf-8", "replace");
    return py::cast(out);
  }, py::arg("model"), py::arg("prompt"), py::kw_only(), py::arg("max_new_tokens") = 64, py::arg("temperature") = 1.0,
        py::arg("top_k") = 0, py::arg("top_p") = 1.0, py::arg("seed") = 1337, py::arg("repetition_penalty") = 1.0,
        py::arg("stop_tokens") = py::none(), py::arg("stop_strings") = std::vector<std::string>{},
        py::arg("tokenizer") = py::none(), py::arg("use_kv_cache") = true, py::arg("on_token") = py::none(),
        "continues a prompt (text, with the model's tokenizer unless one is given; or token ids) by up to "
        "max_new_tokens; returns the new text, or the new token ids");
}

}  // namespace loom::python
