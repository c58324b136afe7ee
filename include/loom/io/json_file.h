// JSON that a user or a file supplied, read one way: a nesting limit checked before nlohmann parses (its parser,
// dump() and destructor recurse, so a file nested 200,000 levels deep overflowed the stack), a key repeated in one
// object refused (nlohmann keeps the last value silently; TOML refuses it too), and failures as
// loom::Error in Loom's words naming the file. Messages show untrusted values through json_excerpt, never dump().
#pragma once

#include <cstddef>
#include <exception>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "loom/io/read_file.h"

namespace loom::io {

// Arrays and objects nested deeper than this are refused (Loom's own files nest at most a few levels).
inline constexpr int kJsonMaxDepth = 256;

// Parses `text`; an error reads "<what>: <reason>" (what names the file, the flag or the metadata key).
nlohmann::json parse_json(std::string_view text, const std::string& what);
nlohmann::ordered_json parse_ordered_json(std::string_view text, const std::string& what);

// Reads (io::read_input_file: a regular file of at most kMaxConfigFileBytes) and parses the file at `path`; errors
// name `what` (the flag or the kind of file) and the path.
nlohmann::json read_json_file(const std::string& path, const std::string& what = "JSON file",
                              FileUse use = FileUse::kInput);

// Throws "<what>: nested more than kJsonMaxDepth levels deep (at byte N)" for text too deep to parse safely.
void check_json_depth(std::string_view text, const std::string& what);

// A value for a message: compact JSON of at most `max_chars` characters ("..." marks a cut), never throwing on
// invalid UTF-8.
std::string json_excerpt(const nlohmann::json& v, size_t max_chars = 60);
std::string json_excerpt(const nlohmann::ordered_json& v, size_t max_chars = 60);

// An exception's text without nlohmann's "[json.exception.type_error.302] " tag.
std::string json_error_text(const std::exception& e);

}  // namespace loom::io
