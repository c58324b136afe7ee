// The JSON provider policy file (LOOM_PROVIDERS_FILE, ProviderPolicy::load_file): the same policy LOOM_PROVIDERS
// spells, with routes per device type. docs/PROVIDERS.md shows a complete file.
#include <fstream>
#include <nlohmann/json.hpp>

#include "loom/core/dispatch.h"
#include "loom/io/json_file.h"

namespace loom {
namespace {

using json = nlohmann::json;

// A string or an array of strings.
std::vector<std::string> string_list(const json& v, const std::string& where) {
  if (v.is_string()) {
    LOOM_REQUIRE(!v.get_ref<const std::string&>().empty(), where, " names an empty provider");
    return {v.get<std::string>()};
  }
  LOOM_REQUIRE(v.is_array(), where, " must be a string or an array of strings, got ", io::json_excerpt(v));
  LOOM_REQUIRE(!v.empty(), where, " is an empty list: it names no provider (leave the key out instead)");
  std::vector<std::string> out;
  for (const auto& s : v) {
    LOOM_REQUIRE(s.is_string(), where, " must hold strings, got ", io::json_excerpt(s));
    LOOM_REQUIRE(!s.get_ref<const std::string&>().empty(), where, " names an empty provider");
    out.push_back(s.get<std::string>());
  }
  return out;
}

// {"op": "provider" or ["p1", "p2"], ...}
std::map<std::string, std::vector<std::string>> op_routes(const json& v, const std::string& where) {
  LOOM_REQUIRE(v.is_object(), where, " must be an object of op -> providers, got ", io::json_excerpt(v));
  std::map<std::string, std::vector<std::string>> out;
  for (const auto& [op, providers] : v.items()) {
    find_op(op);
    out[op] = string_list(providers, where + "." + op);
  }
  return out;
}

ProviderPolicy parse_policy(const json& j) {
  static const std::set<std::string> known = {"routes", "devices", "order",         "deny",
                                              "shadow", "autotune", "autotune_cache", "cpu_fallback", "verify"};
  LOOM_REQUIRE(j.is_object(), "expected a JSON object");
  ProviderPolicy p;
  for (const auto& [key, value] : j.items()) {
    if (!known.count(key))
      LOOM_THROW("unknown key '", key, "' (known: routes, devices, order, deny, shadow, autotune, autotune_cache, ",
                 "cpu_fallback, verify)");
    if (key == "routes") {
      p.routes = op_routes(value, "routes");
    } else if (key == "devices") {
      LOOM_REQUIRE(value.is_object(), "devices must be an object of device type -> routes");
      for (const auto& [device, routes] : value.items()) {
        LOOM_REQUIRE(!device.empty(), "devices has an empty device type (cpu, cuda or a registered one)");
        p.device_routes[device] = op_routes(routes, "devices." + device);
      }
    } else if (key == "order") {
      p.order = string_list(value, "order");
    } else if (key == "deny") {
      for (const auto& d : string_list(value, "deny")) p.denied.insert(d);
    } else if (key == "shadow") {
      if (value.is_string()) {
        LOOM_REQUIRE(!value.get_ref<const std::string&>().empty(), "shadow names an empty provider");
        p.shadows["*"] = value.get<std::string>();
      } else {
        LOOM_REQUIRE(value.is_object(), "shadow must be a provider name or an object of op -> provider");
        for (const auto& [op, provider] : value.items()) {
          if (op != "*") find_op(op);
          LOOM_REQUIRE(provider.is_string() && !provider.get_ref<const std::string&>().empty(), "shadow.", op,
                       " must be a provider name, got ", io::json_excerpt(provider));
          p.shadows[op] = provider.get<std::string>();
        }
      }
    } else if (key == "autotune") {
      if (value.is_boolean()) {
        if (value.get<bool>()) p.autotune.insert("*");
      } else {
        for (const auto& op : string_list(value, "autotune")) {
          if (op != "*") find_op(op);
          p.autotune.insert(op);
        }
      }
    } else if (key == "autotune_cache") {
      LOOM_REQUIRE(value.is_string(), "autotune_cache must be a path");
      p.autotune_cache = value.get<std::string>();
    } else if (key == "cpu_fallback") {
      LOOM_REQUIRE(value.is_boolean(), "cpu_fallback must be true or false");
      p.cpu_fallback = value.get<bool>();
    } else if (key == "verify") {
      LOOM_REQUIRE(value.is_boolean(), "verify must be true or false");
      p.verify = value.get<bool>();
    }
  }
  return p;
}

}  // namespace

ProviderPolicy ProviderPolicy::load_file(const std::string& path) {
  const json j = io::read_json_file(path, "provider policy file");  // its errors name the file already
  try {
    return parse_policy(j);
  } catch (const std::exception& e) {
    LOOM_THROW("provider policy file '", path, "': ", io::json_error_text(e));
  }
}

}  // namespace loom
