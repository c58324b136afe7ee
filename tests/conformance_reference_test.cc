// Stored reference cases for loom-conformance: the PyTorch reference set (conformance/reference/pytorch_refs.json),
// the tiny set the Python writer makes without torch (writer_check.json), a stored case with a wrong reference
// value, and clear errors for missing, corrupt or inconsistent files.
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

#include "loom/core/dispatch.h"
#include "loom/core/op_schema.h"
#include "loom/io/safetensors.h"
#include "providers/conformance.h"
#include "test_files.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const std::string kReferenceDir = std::string(LOOM_SOURCE_DIR) + "/conformance/reference";

std::vector<conformance::CaseResult> run_native(const std::vector<conformance::StoredCase>& cases) {
  return conformance::run_stored(cases, conformance::SuiteOptions{});
}

void expect_all_pass(const std::vector<conformance::CaseResult>& results) {
  EXPECT_FALSE(conformance::suite_failed(results)) << conformance::suite_table(results, "");
  for (const auto& r : results) EXPECT_EQ(r.status, conformance::CaseStatus::kPass) << r.description << ": " << r.detail;
}

// The generated sweep (tools/reference/make_conformance_sweep.py): thousands of cases over every op PyTorch has an
// equivalent for, special values included where the contracts define them.
TEST(ConformanceReference, PyTorchSweepPassesNative) {
  const std::string path = kReferenceDir + "/pytorch_sweep.json";
  if (!fs::exists(path)) GTEST_SKIP() << path << " not generated (tools/reference/make_conformance_sweep.py)";
  auto cases = conformance::load_stored_cases(path);
  EXPECT_GE(cases.size(), 1000u);
  std::set<std::string> ops;
  for (const auto& c : cases) ops.insert(c.op);
  EXPECT_GE(ops.size(), 70u);
  auto results = run_native(cases);
  // Every case of an (op, dtype) with a native CPU kernel runs (the strided attention ops have CUDA kernels only).
  size_t served = 0;
  for (const auto& c : cases)
    served += !dispatch::provider_entries(find_op_schema(c.op)->id, DeviceType::kCPU, c.dtype, "native").empty();
  EXPECT_GE(served, cases.size() * 9 / 10);
  EXPECT_EQ(results.size(), served);
  expect_all_pass(results);
}

TEST(ConformanceReference, PyTorchReferencesPassNative) {
  const std::string path = kReferenceDir + "/pytorch_refs.json";
  if (!fs::exists(path)) GTEST_SKIP() << path << " not generated (tools/reference/make_conformance_refs.py)";
  auto cases = conformance::load_stored_cases(path);
  EXPECT_GE(cases.size(), 15u);
  std::set<DType> dtypes;
  bool strided = false;
  for (const auto& c : cases) dtypes.insert(c.dtype), strided |= c.strided;
  EXPECT_TRUE(dtypes.count(kF32) && dtypes.count(kBF16));
  EXPECT_TRUE(strided);
  auto results = run_native(cases);
  EXPECT_EQ(results.size(), cases.size());  // native serves every op and dtype of the set on the CPU
  expect_all_pass(results);
  EXPECT_NE(conformance::suite_table(results, "").find("gemm [pytorch]"), std::string::npos);
}

TEST(ConformanceReference, PythonWriterFixturePassesNative) {
  auto cases = conformance::load_stored_cases(kReferenceDir + "/writer_check.json");
  ASSERT_EQ(cases.size(), 4u);
  EXPECT_EQ(cases[0].name, "writer_check.json:add_broadcast_f32");
  auto results = run_native(cases);
  ASSERT_EQ(results.size(), 4u);
  expect_all_pass(results);
  EXPECT_NE(conformance::suite_table(results, "").find("add [pytorch]"), std::string::npos);
}

TEST(ConformanceReference, AWrongReferenceValueFailsAndSaysWhere) {
  auto cases = conformance::load_stored_cases(kReferenceDir + "/writer_check.json");
  ASSERT_FALSE(cases.empty());
  conformance::StoredCase wrong = cases[0];
  wrong.outputs[0] = wrong.outputs[0].clone();
  static_cast<double*>(wrong.outputs[0].data())[2] += 1.0;
  auto results = run_native({wrong});
  ASSERT_EQ(results.size(), 1u);
  EXPECT_EQ(results[0].status, conformance::CaseStatus::kFail);
  EXPECT_NE(results[0].detail.find("element 2"), std::string::npos) << results[0].detail;
  EXPECT_NE(conformance::suite_table(results, "loom-conformance").find("--reference pytorch"), std::string::npos);
}

// Rewrites the set's JSON with `edit` applied, into a fresh file beside the tensors.
std::string edited(const test::TempDir& dir, const std::string& source, const std::function<void(json&)>& edit) {
  json doc = json::parse(test::read_all(source));
  edit(doc);
  static int counter = 0;
  std::string path = dir.file("edited" + std::to_string(counter++) + ".json");
  test::write_all(path, doc.dump());
  return path;
}

TEST(ConformanceReference, MissingCorruptOrInconsistentFilesAreClearErrors) {
  test::TempDir dir;
  const std::string good = dir.file("refs.json"), tensors = dir.file("writer_check.safetensors");
  fs::copy_file(kReferenceDir + "/writer_check.json", good);
  fs::copy_file(kReferenceDir + "/writer_check.safetensors", tensors);
  auto load = [](const std::string& p) { return [p] { conformance::load_stored_cases(p); }; };

  test::expect_error_mentioning(load(dir.file("nothing.json")), {"does not exist", "nothing.json"});
  test::write_all(dir.file("garbage.json"), "{\"format\": ");
  test::expect_error_mentioning(load(dir.file("garbage.json")), {"invalid JSON", "garbage.json"});
  test::expect_error_mentioning(load(edited(dir, good, [](json& d) { d["format"] = "other/2"; })),
                                {"format 'other/2'"});
  test::expect_error_mentioning(load(edited(dir, good, [](json& d) { d.erase("cases"); })), {"missing \"cases\""});
  test::expect_error_mentioning(load(edited(dir, good, [](json& d) { d["tensors"] = "absent.safetensors"; })),
                                {"absent.safetensors"});
  test::expect_error_mentioning(load(edited(dir, good, [](json& d) { d["cases"][0]["op"] = "frobnicate"; })),
                                {"no op 'frobnicate' is declared"});
  test::expect_error_mentioning(
      load(edited(dir, good, [](json& d) { d["cases"][1]["inputs"][0]["tensor"] = "no such tensor"; })),
      {"tensor 'no such tensor' is not in", "writer_check.safetensors"});
  test::expect_error_mentioning(
      load(edited(dir, good,
                  [](json& d) { d["cases"][0]["outputs"][0]["tensor"] = d["cases"][0]["inputs"][0]["tensor"]; })),
      {"expected f64"});
  test::expect_error_mentioning(load(edited(dir, good, [](json& d) { d["cases"][0]["dtype"] = 7; })),
                                {"malformed"});
  // A stored tensor of another shape than the description gives: the case fails, naming the argument.
  auto swapped = conformance::load_stored_cases(
      edited(dir, good, [](json& d) { d["cases"][0]["outputs"][0]["tensor"] = d["cases"][1]["outputs"][0]["tensor"]; }));
  auto results = run_native({swapped[0]});
  ASSERT_EQ(results.size(), 1u);
  EXPECT_EQ(results[0].status, conformance::CaseStatus::kFail);
  EXPECT_NE(results[0].detail.find("the description gives"), std::string::npos) << results[0].detail;

  // The tensor file: truncated, or a safetensors file that is not a reference set.
  std::string bytes = test::read_all(tensors);
  test::write_all(tensors, bytes.substr(0, bytes.size() / 2));
  test::expect_error_mentioning(load(good), {"writer_check.safetensors"});
  io::save_safetensors(tensors, {{"x", zeros({2})}});
  test::expect_error_mentioning(load(good), {"is not a reference set"});
}

// The table's columns never run together: a long result ("pass 179/190 (11 declined)") is followed by a space before
// the worst error.
TEST(ConformanceTable, ColumnsStaySeparated) {
  std::vector<conformance::CaseResult> results;
  for (int i = 0; i < 190; ++i) {
    conformance::CaseResult r;
    r.op = "gemm";
    r.index = i;
    r.status = i < 179 ? conformance::CaseStatus::kPass : conformance::CaseStatus::kDeclined;
    r.worst_error = 0.000521;
    r.reference = "naive";
    results.push_back(r);
  }
  const std::string table = conformance::suite_table(results, "");
  EXPECT_NE(table.find("pass 179/190 (11 declined) "), std::string::npos) << table;
  EXPECT_EQ(table.find("declined)0"), std::string::npos) << table;
  EXPECT_NE(table.find("0.000521 "), std::string::npos) << table;
}

}  // namespace
}  // namespace loom
