// Whole numbers from JSON that a user or a file supplied. nlohmann's get<int64_t>() converts a float without a
// check: 3.7 becomes 3, and 1e59 is undefined behaviour (fuzz_checkpoint found it in a checkpoint's state). Readers
// of files take integers through these, which throw nlohmann's type_error (302, as get<>() does for a wrong type),
// so the readers' existing handlers name the file.
#pragma once

#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>

#include "loom/io/json_file.h"
#include <vector>

namespace loom::io {

inline int64_t json_int(const nlohmann::json& j) {
  const bool fits = j.is_number_integer() &&
                    (!j.is_number_unsigned() || j.get<uint64_t>() <= uint64_t(std::numeric_limits<int64_t>::max()));
  if (!fits) throw nlohmann::json::type_error::create(302, "expected a whole number within 64 bits, got " + json_excerpt(j), &j);
  return j.get<int64_t>();
}

inline uint64_t json_uint(const nlohmann::json& j) {
  if (!j.is_number_unsigned())  // nlohmann stores every non-negative integer as unsigned
    throw nlohmann::json::type_error::create(302, "expected a non-negative whole number within 64 bits, got " + json_excerpt(j), &j);
  return j.get<uint64_t>();
}

inline std::vector<int64_t> json_ints(const nlohmann::json& j) {
  if (!j.is_array()) throw nlohmann::json::type_error::create(302, "expected an array of whole numbers, got " + json_excerpt(j), &j);
  std::vector<int64_t> out;
  for (const auto& v : j) out.push_back(json_int(v));
  return out;
}

}  // namespace loom::io
