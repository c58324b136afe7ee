// One way to read untrusted JSON (include/loom/io/json_file.h).
#include "loom/io/json_file.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <unordered_set>
#include <vector>

#include "loom/io/read_file.h"

#include "loom/common/error.h"

namespace loom::io {

void check_json_depth(std::string_view text, const std::string& what) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;  // the escaped character cannot end the string
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      LOOM_REQUIRE(++depth <= kJsonMaxDepth, what, ": JSON nested more than ", kJsonMaxDepth, " levels deep (at byte ",
                   i, ")");
    } else if (c == ']' || c == '}') {
      --depth;  // unbalanced brackets are the parser's to report
    }
  }
}

std::string json_error_text(const std::exception& e) {
  std::string m = e.what();
  if (m.rfind("[json.exception.", 0) == 0) {
    const size_t end = m.find("] ");
    if (end != std::string::npos) m = m.substr(end + 2);
  }
  return m;
}

namespace {

template <typename Json>
Json parse_as(std::string_view text, const std::string& what) {
  check_json_depth(text, what);
  // A key given twice in one object is an error, as in TOML: nlohmann would keep the last value without a word.
  std::vector<std::unordered_set<std::string>> keys;  // one set per object being parsed
  auto no_repeated_keys = [&](int, typename Json::parse_event_t event, Json& parsed) {
    using E = typename Json::parse_event_t;
    if (event == E::object_start) keys.emplace_back();
    else if (event == E::object_end && !keys.empty()) keys.pop_back();
    else if (event == E::key && !keys.empty() && !keys.back().insert(parsed.template get<std::string>()).second)
      LOOM_THROW(what, ": key ", json_excerpt(parsed), " appears twice in one object");
    return true;
  };
  try {
    return Json::parse(text, no_repeated_keys);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    LOOM_THROW(what, ": invalid JSON: ", json_error_text(e));
  }
}

template <typename Json>
void excerpt_into(const Json& v, std::string& out, size_t limit) {
  if (out.size() > limit) return;
  if (v.is_array() || v.is_object()) {
    out += v.is_array() ? '[' : '{';
    bool first = true;
    for (auto it = v.begin(); it != v.end() && out.size() <= limit; ++it) {
      if (!first) out += ',';
      first = false;
      if (v.is_object()) {
        out += Json(it.key()).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
        out += ':';
      }
      excerpt_into(*it, out, limit);
    }
    out += v.is_array() ? ']' : '}';
  } else if (v.is_string()) {
    // A long string is cut before it is escaped, so a 1 GB value costs no 1 GB copy.
    const auto& s = v.template get_ref<const std::string&>();
    out += Json(s.substr(0, limit + 1)).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  } else {
    out += v.dump();
  }
}

template <typename Json>
std::string excerpt(const Json& v, size_t max_chars) {
  std::string out;
  excerpt_into(v, out, max_chars);
  if (out.size() > max_chars) out = out.substr(0, max_chars) + "...";
  return out;
}

}  // namespace

nlohmann::json parse_json(std::string_view text, const std::string& what) {
  return parse_as<nlohmann::json>(text, what);
}

nlohmann::ordered_json parse_ordered_json(std::string_view text, const std::string& what) {
  return parse_as<nlohmann::ordered_json>(text, what);
}

nlohmann::json read_json_file(const std::string& path, const std::string& what, FileUse use) {
  return parse_json(read_input_file(path, kMaxConfigFileBytes, what, use), what + " '" + path + "'");
}

std::string json_excerpt(const nlohmann::json& v, size_t max_chars) { return excerpt(v, max_chars); }
std::string json_excerpt(const nlohmann::ordered_json& v, size_t max_chars) { return excerpt(v, max_chars); }

}  // namespace loom::io
