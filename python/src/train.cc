// loom.Trainer (loom-train's trainer, its settings read by loom-train's own options), token files, and the providers:
// loading a vendor library, the routing policy, and conformance runs whose report comes back as data.
#include <pybind11/numpy.h>

#include <map>

#include "bindings.h"
#include "cli/cli.h"
#include "cli/run_config.h"
#include "cli/train_args.h"
#include "loom/core/dispatch.h"
#include "loom/data/token_file.h"
#include "loom/dispatch_modes.h"
#include "loom/providers.h"
#include "loom/train/trainer.h"
#ifdef LOOM_WITH_DIOPI
#include "loom/diopi.h"
#endif

namespace loom::python {

namespace {

// Settings as loom-train's flags take them ("batch-size" -> its values as text), from a dict shaped like a config file
// (sections or flat keys; checked by the same reader as loom-train --config files).
std::map<std::string, std::vector<std::string>> settings_of(const py::dict& d, const std::string& what) {
  const std::string json = py::module_::import("json").attr("dumps")(d).cast<std::string>();
  std::map<std::string, std::vector<std::string>> out;
  try {
    for (CLI::ConfigItem& item : cli::read_run_config(what, json)) out[item.name] = std::move(item.inputs);
  } catch (const CLI::Error& e) {
    // The reader names a file as "--config PATH: ..."; a dict is no file.
    std::string text = cli::error_line("loom-train", e.what());
    const std::string prefix = "--config " + what + ": ";
    if (text.rfind(prefix, 0) == 0) text = what + ": " + text.substr(prefix.size());
    throw Error(text);
  }
  return out;
}

// loom-train's arguments for a config file or dict and keyword settings (which win, as the command line does).
std::vector<std::string> train_args(const py::object& config, const py::kwargs& kwargs) {
  std::vector<std::string> args;
  std::map<std::string, std::vector<std::string>> settings;
  if (py::isinstance<py::dict>(config)) {
    settings = settings_of(config.cast<py::dict>(), "the config dict");
  } else if (!config.is_none()) {
    args = {"--config", py::str(py::module_::import("os").attr("fspath")(config)).cast<std::string>()};
  }
  py::dict given;
  for (const auto& [k, v] : kwargs) given[k] = v;
  for (auto& [flag, values] : settings_of(given, "keyword settings")) settings[flag] = std::move(values);
  for (const auto& [flag, values] : settings)
    for (const std::string& v : values) args.push_back("--" + flag + "=" + v);
  return args;
}

py::dict step_dict(const train::StepStats& s) {
  py::dict d;
  d["step"] = s.step;
  d["loss"] = s.loss;
  d["lr"] = s.lr;
  d["grad_norm"] = s.grad_norm;
  d["ms"] = s.ms;
  d["tokens_per_second"] = s.tokens_per_second;
  for (const auto& [phase, ms] : s.phases) d[py::str("phase_ms/" + phase)] = ms;
  for (const auto& [name, value] : s.metrics) d[py::str(name)] = value;  // "moe/aux_loss", "moe/dropped_fraction"
  return d;
}

// A callback's answer: False stops the run; anything else (None included) goes on.
bool keep_going(const py::object& answer) { return !(py::isinstance<py::bool_>(answer) && !answer.cast<bool>()); }

py::dict verification_dict(const dispatch::Verification& v) {
  py::dict d;
  d["provider"] = v.provider;
  d["op"] = v.op;
  d["dtype"] = v.dtype;
  d["device"] = v.device;
  d["library"] = v.library;
  d["library_hash"] = v.library_hash;
  d["interface"] = v.interface;
  d["status"] = v.status;
  d["cases"] = v.cases;
  d["failed"] = v.failed;
  d["declined"] = v.declined;
  d["when"] = v.when;
  d["detail"] = v.detail;
  return d;
}

}  // namespace

void bind_train(py::module_& m) {
  py::class_<train::Trainer>(m, "Trainer", "loom-train's trainer, with the same settings (docs/TRAINING.md)")
      .def(py::init([](const py::object& config, bool quiet, const py::kwargs& settings) {
        cli::TrainArgs args = cli::parse_train_args(train_args(config, settings));
        args.options.quiet = quiet;
        py::gil_scoped_release release;
        cli::load_train_libraries(args);
        return std::make_unique<train::Trainer>(args.options);
      }), py::arg("config") = py::none(), py::kw_only(), py::arg("quiet") = false,
           "config: a TOML or JSON file as loom-train --config reads, or a dict shaped the same (sections or flat "
           "keys); keyword settings win over it, as loom-train's command line does over --config")
      .def("run", [](train::Trainer& t, const py::object& on_step, const py::object& on_eval) {
        train::RunCallbacks callbacks;
        if (!on_step.is_none())
          callbacks.on_step = [&on_step](const train::StepStats& s) {
            py::gil_scoped_acquire gil;
            return keep_going(on_step(step_dict(s)));
          };
        if (!on_eval.is_none())
          callbacks.on_eval = [&on_eval](int64_t step, const std::vector<std::pair<std::string, double>>& metrics) {
            py::gil_scoped_acquire gil;
            py::dict d;
            d["step"] = step;
            for (const auto& [k, v] : metrics) d[py::str(k)] = v;
            return keep_going(on_eval(d));
          };
        py::gil_scoped_release release;
        t.run(callbacks);
      }, py::arg("on_step") = py::none(), py::arg("on_eval") = py::none(),
           "trains to the configured steps; on_step(metrics) after every step and on_eval(metrics) after every "
           "evaluation get a dict, and returning False stops the run (it then ends as at its last step)")
      .def("train_step", [](train::Trainer& t) {
        train::StepStats s;
        {
          py::gil_scoped_release release;
          s = t.train_step();
        }
        return step_dict(s);
      }, "one optimizer step (all micro-batches), without the logging, evaluation and checkpoints of run()")
      .def("evaluate", [](train::Trainer& t, int64_t batches) {
        py::gil_scoped_release release;
        return t.evaluate(batches);
      }, py::arg("batches") = 0, "the mean loss over the first `batches` validation batches (0: all)")
      .def("sample", [](train::Trainer& t, int64_t tokens) {
        std::string text;
        {
          py::gil_scoped_release release;
          text = t.sample(tokens);
        }
        return py::bytes(text).attr("decode")("utf-8", "replace");
      }, py::arg("tokens") = 64)
      .def("save_checkpoint", [](train::Trainer& t, const std::string& path) {
        py::gil_scoped_release release;
        t.save_checkpoint(path);
      }, py::arg("path"), "a Loom training checkpoint (model, AdamW state, data position), as loom-train writes")
      .def("load_checkpoint", [](train::Trainer& t, const std::string& path) {
        py::gil_scoped_release release;
        t.load_checkpoint(path);
      }, py::arg("path"))
      .def_property_readonly("step", &train::Trainer::step)
      .def_property_readonly("model", &train::Trainer::shared_model, "the model being trained (not a copy)")
      .def_property_readonly("history", [](const train::Trainer& t) {
        py::list out;
        for (const train::StepStats& s : t.history()) out.append(step_dict(s));
        return out;
      })
      .def_property_readonly("grad_accumulation_steps", &train::Trainer::grad_accumulation_steps);

  py::module_ data = m.def_submodule("data", "llm.c token files (loom/data/token_file.h)");
  data.def("write_tokens", [](const std::string& path, const py::array_t<int32_t, py::array::c_style | py::array::forcecast>& tokens,
                              int bits) {
    LOOM_REQUIRE(bits == 16 || bits == 32, "write_tokens: bits must be 16 or 32, got ", bits);
    std::span<const int32_t> span(tokens.data(), size_t(tokens.size()));
    data::write_token_file(path, span, bits == 16 ? data::TokenWidth::kU16 : data::TokenWidth::kU32);
  }, py::arg("path"), py::arg("tokens"), py::arg("bits") = 16, "writes an llm.c token shard (loom-train's data)");
  data.def("read_tokens", [](const std::string& path) {
    const std::vector<int32_t> t = data::read_token_file(path);
    return py::array_t<int32_t>(py::ssize_t(t.size()), t.data());
  }, py::arg("path"));

  py::module_ p = m.def_submodule("providers", "vendor kernel libraries and routing (docs/PROVIDERS.md)");
  p.def("load", &providers::load, py::arg("path"), py::arg("name") = "",
        "loads a library built against Loom's C ABI; returns its provider name");
  p.def("unload", &providers::unload, py::arg("name"));
  p.def("loaded", [] {
    py::list out;
    for (const providers::LoadedProvider& l : providers::loaded()) {
      py::dict d;
      d["name"] = l.name;
      d["path"] = l.path;
      d["version"] = l.version;
      d["abi"] = std::to_string(l.abi_major) + "." + std::to_string(l.abi_minor);
      d["ops"] = l.ops;
      d["warnings"] = l.warnings;
      d["device_type"] = l.device_type;
      out.append(d);
    }
    return out;
  });
  p.def("abi_version", &providers::abi_version);
  p.def("load_diopi", [](const std::string& path) -> std::string {
#ifdef LOOM_WITH_DIOPI
    return providers::load_diopi(path);
#else
    (void)path;
    throw Error("load_diopi: this Loom was built without the DIOPI bridge (LOOM_DIOPI)");
#endif
  }, py::arg("path"), "loads a DIOPI implementation library as provider 'diopi'");
  p.def("names", &dispatch::providers, "every provider with at least one kernel");
  p.def("set_policy", [](const std::string& spec) {
    const bool file = spec.size() > 5 && spec.substr(spec.size() - 5) == ".json";
    dispatch::set_policy(file ? ProviderPolicy::load_file(spec) : ProviderPolicy::parse(spec));
  }, py::arg("spec"), "a policy as LOOM_PROVIDERS writes it ('verify;acme:gemm;native'), or a JSON policy file");
  p.def("policy", [] { return dispatch::policy().str(); });
  p.def("reset_policy", &dispatch::reset_policy, "back to LOOM_PROVIDERS (or none)");
  p.def("set_verify_cache", &dispatch::set_verify_cache, py::arg("path"),
        "where conformance results are kept (default LOOM_VERIFY_CACHE, else ~/.cache/loom/verified.json; '' keeps "
        "them in this process only)");
  p.def("explain", [](const std::string& op, const py::object& device, const py::object& dtype) {
    return dispatch::explain_str(op, to_device(device).type, to_dtype(dtype));
  }, py::arg("op"), py::arg("device") = "cpu", py::arg("dtype") = "f32",
        "which kernel serves the op and why the others do not");

  m.def("conformance", [](const std::string& provider, const py::object& device,
                          const std::vector<std::string>& ops, const std::vector<py::object>& dtypes) {
    std::vector<DType> dts;
    for (const py::object& d : dtypes) dts.push_back(to_dtype(d));
    const Device dev = to_device(device);
    std::vector<dispatch::Verification> results;
    {
      py::gil_scoped_release release;
      results = dispatch::verify_provider(provider, dev, ops, dts);
    }
    py::list out;
    for (const dispatch::Verification& v : results) out.append(verification_dict(v));
    return out;
  }, py::arg("provider"), py::kw_only(), py::arg("device") = "cpu", py::arg("ops") = std::vector<std::string>{},
        py::arg("dtypes") = std::vector<py::object>{},
        "runs the conformance cases for a provider's kernels on a device (ops and dtypes: all it registers unless "
        "given) against float64 references; one dict per (op, dtype) with its status ('verified', 'failed' or "
        "'declined'), case counts and the first failure. The results are recorded for verified routing");
}

}  // namespace loom::python
