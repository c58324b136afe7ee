// Checkpoints written by an earlier trainer (tests/fixtures/former_checkpoints, made by
// tools/parity/former_checkpoints.sh) load into this one: a ZeRO-3 x 2 sharded checkpoint resumed by one process
// (a change of mesh), and a one-process single file, each continuing with the losses and gradient norms the earlier
// trainer gave. The multi-rank resumes (ZeRO-3 over 2 and 4 ranks, ZeRO-1's per-rank optimizer files) are in
// tests/distributed/dist_check.cc.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "loom/train/trainer.h"
#include "test_files.h"

namespace loom {
namespace {

const std::filesystem::path kFixture = std::filesystem::path(LOOM_SOURCE_DIR) / "tests" / "fixtures" / "former_checkpoints";

// Steps 3 and 4 resumed from `checkpoint` (within the fixture) by one process, against what the earlier trainer gave
// (`expected` in expected.json). Rounding may differ between machines (another BLAS): 1e-5 relative.
void expect_resume_continues(const std::string& checkpoint, const std::string& expected) {
  const nlohmann::json want = nlohmann::json::parse(test::read_all((kFixture / "expected.json").string())).at(expected);
  test::TempDir dir;
  train::TrainOptions o;  // as `loom-train --resume C --train-data train.bin --steps 4 --checkpoint-dir D` gives them
  o.resume = (kFixture / checkpoint).string();
  o.train_data = (kFixture / "train.bin").string();
  o.steps = 4;
  o.checkpoint_dir = dir.path().string();
  o.given = std::set<std::string>{"resume", "train-data", "steps", "checkpoint-dir"};
  o.quiet = true;
  train::Trainer t(o);  // the checkpoint's model and settings
  ASSERT_EQ(t.step(), 2);
  ASSERT_EQ(want.size(), 2u);
  for (const auto& row : want) {
    const train::StepStats s = t.train_step();
    EXPECT_EQ(s.step, row.at(0).get<int64_t>());
    const double loss = row.at(1).get<double>(), norm = row.at(2).get<double>();
    EXPECT_LT(std::abs(s.loss - loss), 1e-5 * loss) << checkpoint << " step " << s.step << ": " << s.loss << " vs " << loss;
    EXPECT_LT(std::abs(s.grad_norm - norm), 1e-5 * norm)
        << checkpoint << " step " << s.step << ": " << s.grad_norm << " vs " << norm;
  }
}

TEST(CheckpointFixture, AFormerShardedZero3CheckpointResumesInOneProcess) {
  expect_resume_continues("zero3_x2/step_000002", "zero3_x2_resumed_by_one_rank");
}

TEST(CheckpointFixture, AFormerSingleFileResumes) {
  expect_resume_continues("single", "single_resumed_by_one_rank");  // the directory: its latest
}

}  // namespace
}  // namespace loom
