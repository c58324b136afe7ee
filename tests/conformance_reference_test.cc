// Stored reference cases for loom-conformance: the PyTorch reference set (conformance/reference/pytorch_refs.json),
// the tiny set the Python writer makes without torch (writer_check.json), a set written here from Loom's own float64
// results, the norm backward harnesses, and clear errors for missing, corrupt or inconsistent files.
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

#include "loom/io/safetensors.h"
#include "providers/conformance.h"
#include "test_files.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const std::string kReferenceDir = std::string(LOOM_SOURCE_DIR) + "/conformance/reference";

conformance::Case declarative(const std::string& op, std::vector<Shape> shapes, std::vector<DType> dtypes,
                              const std::string& attrs = "{}") {
  conformance::Case c;
  c.name = "test " + op;
  c.op = op;
  c.shapes = std::move(shapes);
  c.dtypes = std::move(dtypes);
  c.attrs_json = attrs;
  return c;
}

void expect_all_pass(const std::vector<conformance::Result>& results, const std::string& reference) {
  EXPECT_FALSE(conformance::any_failure(results)) << conformance::format_table(results);
  for (const auto& r : results) {
    EXPECT_EQ(r.status, conformance::Status::kPass) << r.case_name << ": " << r.detail;
    EXPECT_EQ(r.reference, reference) << r.case_name;
  }
}

// A reference set written from Loom's float64 CPU kernels, covering the harness shapes the PyTorch set uses.
std::vector<conformance::Case> export_cases() {
  return {
      declarative("gemm", {}, {kF32, kBF16}, R"({"m": 5, "n": 3, "k": 7, "trans_a": true, "epilogue": 1})"),
      declarative("add", {{3, 1, 5}, {4, 5}}, {kF32}),
      declarative("layer_norm_backward", {{4, 9}}, {kF32}),
      declarative("cross_entropy_backward", {{6, 11}}, {kF32}),  // a 0-d grad_loss
      declarative("scaled_dot_product_attention_backward", {{1, 2, 5, 4}, {1, 1, 5, 4}}, {kF32}),
      declarative("adamw_update", {{13}}, {kBF16}, R"({"step": 3, "weight_decay": 0.1})"),
  };
}

TEST(ConformanceReference, PyTorchReferencesPassNative) {
  const std::string path = kReferenceDir + "/pytorch_refs.json";
  if (!fs::exists(path)) GTEST_SKIP() << path << " not generated (tools/reference/make_conformance_refs.py)";
  auto cases = conformance::load_reference_cases(path);
  EXPECT_GE(cases.size(), 15u);
  std::set<DType> dtypes;
  bool strided = false;
  for (const auto& c : cases) {
    ASSERT_TRUE(c.stored);
    EXPECT_EQ(c.dtypes.size(), 1u);
    dtypes.insert(c.dtypes[0]);
    strided |= c.strided;
  }
  EXPECT_TRUE(dtypes.count(kF32) && dtypes.count(kBF16));
  EXPECT_TRUE(strided);
  expect_all_pass(conformance::run(cases, "native", Device()), "pytorch");
}

TEST(ConformanceReference, PythonWriterFixturePassesNative) {
  auto cases = conformance::load_reference_cases(kReferenceDir + "/writer_check.json");
  ASSERT_EQ(cases.size(), 4u);
  EXPECT_EQ(cases[0].name, "writer_check.json:add_broadcast_f32");
  EXPECT_EQ(cases[0].stored->peer, "python");
  auto results = conformance::run(cases, "native", Device());
  expect_all_pass(results, "pytorch");
  std::string table = conformance::format_table(results);
  EXPECT_NE(table.find("add [pytorch]"), std::string::npos) << table;
  EXPECT_NE(table.find("(pytorch on python in bf16: 0)"), std::string::npos) << table;
  json report = json::parse(conformance::to_json(results, "native", Device()));
  EXPECT_EQ(report["results"][0]["reference"], "pytorch");
  EXPECT_EQ(report["results"][0]["peer_worst_error"], 0.0);
}

TEST(ConformanceReference, LoomWrittenSetRoundTripsAndCatchesWrongValues) {
  test::TempDir dir;
  std::string path = conformance::write_reference_cases(export_cases(), dir.path().string(), "loom_refs");
  auto cases = conformance::load_reference_cases(path);
  ASSERT_EQ(cases.size(), 7u);  // one per (case, dtype)
  expect_all_pass(conformance::run(cases, "native", Device()), "loom-stored");

  // One reference element off by a lot: the case fails and says where.
  auto changed = std::make_shared<conformance::StoredReference>(*cases[0].stored);
  changed->outputs[0] = changed->outputs[0].clone();
  static_cast<double*>(changed->outputs[0].data())[2] += 1.0;
  conformance::Case wrong = cases[0];
  wrong.stored = changed;
  auto results = conformance::run({wrong}, "native", Device());
  ASSERT_EQ(results.size(), 1u);
  EXPECT_EQ(results[0].status, conformance::Status::kFail);
  EXPECT_NE(results[0].detail.find("output 0 element 2"), std::string::npos) << results[0].detail;
  EXPECT_TRUE(conformance::any_failure(results));
}

TEST(ConformanceReference, NormBackwardHarnesses) {
  auto results = conformance::run(
      {declarative("layer_norm_backward", {{5, 17}}, {kF32, kF64, kBF16}),
       declarative("layer_norm_backward", {{2, 3, 8}}, {kF32}, R"({"affine": false})"),
       declarative("rms_norm_backward", {{6, 21}}, {kF32, kBF16}, R"({"eps": 1e-6})"),
       declarative("rms_norm_backward", {{1, 9}}, {kF64}, R"({"affine": false})")},
      "native", Device());
  ASSERT_EQ(results.size(), 7u);
  expect_all_pass(results, "loom");
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
  const std::string good = conformance::write_reference_cases(export_cases(), dir.path().string(), "refs");
  const std::string tensors = dir.file("refs.safetensors");
  auto load = [](const std::string& p) { return [p] { conformance::load_reference_cases(p); }; };

  test::expect_error_mentioning(load(dir.file("nothing.json")), {"no reference file", "nothing.json"});
  test::write_all(dir.file("garbage.json"), "{\"format\": ");
  test::expect_error_mentioning(load(dir.file("garbage.json")), {"corrupt reference file", "garbage.json"});
  test::expect_error_mentioning(load(edited(dir, good, [](json& d) { d["format"] = "other/2"; })),
                                {"format 'other/2'"});
  test::expect_error_mentioning(load(edited(dir, good, [](json& d) { d.erase("cases"); })), {"missing \"cases\""});
  test::expect_error_mentioning(load(edited(dir, good, [](json& d) { d["tensors"] = "absent.safetensors"; })),
                                {"absent.safetensors"});
  test::expect_error_mentioning(load(edited(dir, good, [](json& d) { d["cases"][0]["op"] = "frobnicate"; })),
                                {"no harness for op 'frobnicate'"});
  test::expect_error_mentioning(
      load(edited(dir, good, [](json& d) { d["cases"][1]["inputs"][0]["tensor"] = "no such tensor"; })),
      {"tensor 'no such tensor' is not in", "refs.safetensors"});
  test::expect_error_mentioning(load(edited(dir, good, [](json& d) { d["cases"][2]["inputs"].erase(1); })),
                                {"1 inputs; op add takes 2"});
  test::expect_error_mentioning(
      load(edited(dir, good,
                  [](json& d) { d["cases"][2]["outputs"][0]["tensor"] = d["cases"][2]["inputs"][0]["tensor"]; })),
      {"expected f64"});
  test::expect_error_mentioning(
      load(edited(dir, good,
                  [](json& d) { d["cases"][2]["outputs"][0]["tensor"] = d["cases"][3]["outputs"][0]["tensor"]; })),
      {"reference output 0 is f64[4, 9]", "the op's output is [3, 4, 5]"});
  test::expect_error_mentioning(load(edited(dir, good, [](json& d) { d["cases"][0]["dtype"] = 7; })),
                                {"malformed"});

  // The tensor file: truncated, or a safetensors file that is not a reference set.
  std::string bytes = test::read_all(tensors);
  test::write_all(tensors, bytes.substr(0, bytes.size() / 2));
  test::expect_error_mentioning(load(good), {"refs.safetensors"});
  io::save_safetensors(tensors, {{"x", zeros({2})}});
  test::expect_error_mentioning(load(good), {"is not a reference set"});
}

}  // namespace
}  // namespace loom
