// The descriptions of the mixture-of-experts ops whose shapes the named dims cannot say alone, and the grouped
// gemm's group offsets.
#include "kernels/moe_kernel.h"

namespace loom {

std::vector<int64_t> grouped_gemm_offsets(const char* op, const std::vector<int64_t>& group_sizes, int64_t rows) {
  std::vector<int64_t> offsets(group_sizes.size() + 1, 0);
  for (size_t g = 0; g < group_sizes.size(); ++g) {
    LOOM_REQUIRE(group_sizes[g] >= 0, op, ": group ", g, " has ", group_sizes[g], " rows");
    offsets[g + 1] = offsets[g] + group_sizes[g];
  }
  LOOM_REQUIRE(offsets.back() <= rows, op, ": the groups hold ", offsets.back(), " rows, more than the ", rows,
               " rows of the input");
  return offsets;
}

namespace {

// Uneven groups for a case: sizes in proportion to (3g + 1) mod 5 over G groups (some empty, "experts that get no
// token"), summing to M, or to M - 1 when M is odd and above 2 (a zero row past the groups).
std::vector<int64_t> case_group_sizes(int64_t groups, int64_t rows) {
  const int64_t used = rows > 2 && rows % 2 == 1 ? rows - 1 : rows;
  std::vector<int64_t> w(static_cast<size_t>(groups)), sizes(size_t(groups), 0);
  int64_t total = 0;
  for (int64_t g = 0; g < groups; ++g) total += w[size_t(g)] = (3 * g + 1) % 5;
  int64_t given = 0, last = 0;
  for (int64_t g = 0; g < groups; ++g) {
    sizes[size_t(g)] = total ? used * w[size_t(g)] / total : 0;
    given += sizes[size_t(g)];
    if (w[size_t(g)]) last = g;
  }
  sizes[size_t(last)] += used - given;
  return sizes;
}

void grouped_gemm_rule(SuiteCase& c, const OpSchema&) {
  c.attr("group_sizes")->ints = case_group_sizes(c.dim("G"), c.dim("M"));
}

}  // namespace

OpSchema moe_permute_schema() {
  auto assignments = [](const SuiteCase& c) { return Shape{c.dim("T") * c.dim("K"), c.dim("C")}; };
  auto sources = [](const SuiteCase& c) { return Shape{c.dim("T") * c.dim("K")}; };
  return OpSchema()
      .in("x", "T C").in("experts", "T K", DTypeRule::kIndex).values(Values::kIndexBelow, "E")
      .out("out", "N C").shape_fn(assignments).out("rows", "T K", DTypeRule::kI64)
      .out("sources", "N", DTypeRule::kI64).shape_fn(sources).out("counts", "E", DTypeRule::kI64)
      .attr("capacity", {-1.0, 0.0, 1.0, 3.0}).dim("T", {0}).dim("E", {1, 8}).dispatch_on("x").abi_since(4)
      .special_values("rows are copied: NaN and inf move with them");
}

OpSchema moe_unpermute_backward_schema() {
  return OpSchema()
      .in("grad", "T C").in("y", "N C")
      .in("rows", "T K", DTypeRule::kIndex).values(Values::kIndexBelow, "N")
      .in("sources", "N", DTypeRule::kIndex).values(Values::kIndexBelow, "A")
      .in_opt("weights", "T K", DTypeRule::kStats)
      .out_opt("grad_y", "N C").out_opt("grad_weights", "T K", DTypeRule::kStats)
      .dim("T", {0}).dim("N", {1}).dispatch_on("grad").abi_since(4)
      .case_rule([](SuiteCase& c, const OpSchema& s) {
        c.dim("A") = c.dim("T") * c.dim("K");  // the assignments sources index
        if (c.dim("A") == 0) c.dim("N") = 0;   // no assignment: no row (a source could only be -1)
        c.skip = !c.present[size_t(s.tensor_index("grad_y"))] && !c.present[size_t(s.tensor_index("grad_weights"))];
      });
}

OpSchema grouped_gemm_schema() {
  auto b_shape = [](const SuiteCase& c) {
    return c.attr_int("trans_b") ? Shape{c.dim("G"), c.dim("N"), c.dim("K")} : Shape{c.dim("G"), c.dim("K"), c.dim("N")};
  };
  return OpSchema()
      .in("a", "M K").in("b", "G K N").shape_fn(b_shape).out("c", "M N")
      .attr("trans_b", {1.0, 0.0}).dim("G", {1, 8, 64}).dim("M", {0}).dim("K", {0}).accumulates("K")
      .dispatch_on("a").autocast(Autocast::kCastInputs).abi_since(4).case_rule(grouped_gemm_rule)
      .special_values("IEEE, as the float64 sum: NaN and inf in a or b reach the elements they touch");
}

OpSchema grouped_gemm_weight_grad_schema() {
  auto grad_b_shape = [](const SuiteCase& c) {
    return c.attr_int("trans_b") ? Shape{c.dim("G"), c.dim("N"), c.dim("K")} : Shape{c.dim("G"), c.dim("K"), c.dim("N")};
  };
  return OpSchema()
      .in("a", "M K").in("grad", "M N").out("grad_b", "G K N", DTypeRule::kWideOrSame).shape_fn(grad_b_shape)
      .attr("trans_b", {1.0, 0.0}).dim("G", {1, 8, 64}).dim("M", {0}).accumulates("M")
      .dispatch_on("a").abi_since(4).case_rule(grouped_gemm_rule)
      .special_values("IEEE, as the float64 sum: NaN and inf in a or grad reach the elements they touch");
}

}  // namespace loom
