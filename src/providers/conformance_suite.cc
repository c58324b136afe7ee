// The conformance suite's driver: for every op and dtype the provider serves, its generated cases and the check of
// repeated calls on the same buffers, each run and judged, in this process or over worker processes
// (conformance_workers.h), with progress after each (op, dtype).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <tuple>

#include "loom/core/op_schema.h"
#include "providers/conformance_internal.h"
#include "providers/conformance_workers.h"
#include "providers/naive_reference.h"

namespace loom::conformance {

using namespace detail;

double case_cost(const OpSchema& s, const ExplicitCase& e) {
  const std::string& acc = s.accumulate_dim;
  bool scatters = false;  // an op that adds by index (embedding_backward, scatter_add) or picks by it (the losses)
  for (const TensorSpec& t : s.tensors) scatters |= t.values == Values::kIndexBelow || t.values == Values::kTargets;
  double elements = 0, summed_input = 0, unsummed_output = 0;
  for (size_t i = 0; i < e.tensors.size() && i < s.tensors.size(); ++i) {
    const TensorCase& t = e.tensors[i];
    if (!t.present) continue;
    double n = 0;
    if (s.tensors[i].list)
      for (const TensorCase& piece : t.list) n += double(numel_of(piece.shape));
    else
      n = double(numel_of(t.shape));
    elements += n;
    const bool holds = std::find(s.tensors[i].shape.begin(), s.tensors[i].shape.end(), acc) != s.tensors[i].shape.end();
    if (is_input(s.tensors[i].role) && holds) summed_input = std::max(summed_input, n);
    if (!is_input(s.tensors[i].role) && !holds) unsummed_output = std::max(unsummed_output, n);
  }
  double sums = 0;
  if (!acc.empty()) {
    auto it = e.dims.find(acc);
    const double terms = double(it != e.dims.end() ? std::max<int64_t>(1, it->second) : 1);
    // A reduction sums `terms` values into each element of an output without that dim; a scatter reads each
    // input element once. Never more than the op's loop nest over all its dims (a sum over another dim than the
    // accumulated one).
    sums = scatters ? summed_input : unsummed_output * terms;
    double nest = 1;
    for (const auto& [name, size] : e.dims) nest *= double(std::max<int64_t>(1, size));
    sums = std::min(sums, nest);
  }
  return kCaseSetupCost + kElementCost * elements + sums;
}

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

uint64_t case_seed(const SuiteOptions& o, DType dt, size_t k) { return o.seed * 7919u + k * 104729u + uint64_t(dt); }

bool same_attrs(const ExplicitCase& a, const ExplicitCase& b) {
  if (a.attrs.size() != b.attrs.size()) return false;
  for (size_t i = 0; i < a.attrs.size(); ++i)
    if (a.attrs[i].first != b.attrs[i].first || a.attrs[i].second.str() != b.attrs[i].second.str()) return false;
  return true;
}

bool same_tensors(const ExplicitCase& a, const ExplicitCase& b) {
  if (a.tensors.size() != b.tensors.size()) return false;
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const TensorCase &x = a.tensors[i], &y = b.tensors[i];
    if (x.present != y.present || x.shape != y.shape || x.strides != y.strides || x.offset != y.offset ||
        x.alias_of != y.alias_of || x.dtype != y.dtype || x.role != y.role || x.list.size() != y.list.size())
      return false;
    for (size_t k = 0; k < x.list.size(); ++k)
      if (x.list[k].shape != y.list[k].shape || x.list[k].strides != y.list[k].strides ||
          x.list[k].offset != y.list[k].offset || x.list[k].dtype != y.list[k].dtype)
        return false;
  }
  return true;
}

// The cases of the repeat check: an accepted generated case of plain values, small (the check is one case's cost),
// preferring every tensor present, then attributes at their plain value (not an alpha of 0, which leaves B unread),
// then a case with the same tensors and other attributes among the generated ones (`second`, else `first`), then
// more elements: more for a cache to get wrong.
struct RepeatCases {
  size_t first = 0, second = 0;
};
std::optional<RepeatCases> repeat_cases(const Generated& g) {
  std::optional<RepeatCases> best;
  std::tuple<bool, int, bool, double> best_rank{};
  for (size_t k = 0; k < g.plans.size(); ++k) {
    const Plan& p = g.plans[k];
    if (!g.accepted[k] || p.fuzz) continue;
    bool plain = true, all_present = true;
    double elements = 0;
    for (size_t i = 0; i < p.e.tensors.size(); ++i) {
      all_present &= p.e.tensors[i].present;
      plain &= !p.e.tensors[i].present ||
               (p.e.tensors[i].values == ValueClass::kNormal && !p.e.tensors[i].out_of_range);
      if (p.e.tensors[i].present) elements += double(numel_of(p.e.tensors[i].shape));
    }
    if (!plain || elements > 4096) continue;
    int plain_attrs = 0;
    for (size_t q = 0; q < g.model.params.size(); ++q)
      plain_attrs += g.model.params[q].kind == ParamKind::kAttr && p.effective[q] == 0;
    size_t twin = k;
    for (size_t j = 0; j < g.plans.size() && twin == k; ++j)
      if (j != k && g.accepted[j] && !g.plans[j].fuzz && same_tensors(p.e, g.plans[j].e) &&
          std::none_of(g.plans[j].e.tensors.begin(), g.plans[j].e.tensors.end(),
                       [](const TensorCase& t) { return t.out_of_range != 0; }) &&
          !same_attrs(p.e, g.plans[j].e))
        twin = j;
    const auto rank = std::make_tuple(all_present, plain_attrs, twin != k, elements);
    if (!best || rank > best_rank) best_rank = rank, best = RepeatCases{k, twin};
  }
  return best;
}

// The generated cases of the (op, dtype) a run is at: a worker is handed several units of one in a row.
class Generations {
 public:
  explicit Generations(const SuiteOptions& o) : o_(o) {}
  const Generated& of(const OpSchema& s, DType dt) {
    if (!g_ || s_ != &s || dt_ != dt) {
      g_ = std::make_unique<Generated>(generate_for(s, dt, o_));
      s_ = &s, dt_ = dt;
      repeat_ = o_.generated ? repeat_cases(*g_) : std::nullopt;
    }
    return *g_;
  }
  // The cases of the row: the generated and fuzz ones, then the repeat check (index plans.size()).
  int cases(const OpSchema& s, DType dt) {
    const int generated = int(of(s, dt).plans.size());
    return generated + (repeat_ ? 1 : 0);
  }
  const std::optional<RepeatCases>& repeat() const { return repeat_; }

 private:
  const SuiteOptions& o_;
  std::unique_ptr<Generated> g_;
  const OpSchema* s_ = nullptr;
  DType dt_ = kF32;
  std::optional<RepeatCases> repeat_;
};

ExplicitCase seeded(const Generated& g, const SuiteOptions& o, DType dt, size_t k) {
  ExplicitCase e = g.plans[k].e;
  e.seed = case_seed(o, dt, k);
  return e;
}

std::vector<CaseResult> run_cases(const OpSchema& s, DType dt, Generations& gens, const std::vector<int>& cases,
                                  const SuiteOptions& o) {
  const Generated& g = gens.of(s, dt);
  std::vector<CaseResult> results;
  for (int k : cases) {
    try {
      if (size_t(k) < g.plans.size()) {
        results.push_back(run_explicit(s, seeded(g, o, dt, size_t(k)), o, k, g.plans[size_t(k)].fuzz));
      } else {
        LOOM_REQUIRE(gens.repeat() && size_t(k) == g.plans.size(), "conformance: ", s.name, " ", dtype_name(dt),
                     " has no case ", k);
        // The second call: new values, the same attributes; the third (where a case has the same tensors and other
        // attributes): new values and its attributes.
        const RepeatCases rc = *gens.repeat();
        std::vector<ExplicitCase> again{seeded(g, o, dt, rc.first)};
        if (rc.second != rc.first) again.push_back(seeded(g, o, dt, rc.second));
        for (size_t call = 0; call < again.size(); ++call) again[call].seed = case_seed(o, dt, size_t(k) + call);
        results.push_back(run_repeated(s, seeded(g, o, dt, rc.first), again, o, k));
      }
    } catch (const std::exception& ex) {
      CaseResult& r = results.emplace_back();
      r.op = s.name, r.dtype = dt, r.index = k, r.status = CaseStatus::kFail, r.worst_error = INFINITY;
      r.repeat = size_t(k) == g.plans.size();
      r.detail = std::string("error: ") + ex.what();
    }
  }
  return results;
}

// One (op, dtype) of a run: its cases and their estimated costs.
struct Row {
  const OpSchema* s = nullptr;
  DType dtype = kF32;
  std::vector<int> cases;
  std::vector<double> costs;
  std::vector<CaseResult> results;  // in the order of `cases`, as they come back
  int pending = 0;                  // cases not back yet
  double seconds = 0;
};

// Keeps `n` of a row's cases, spread over their costs from the cheapest to the dearest (the sizes that take a
// kernel's short paths and its long ones), in their order; `total_cost` loses the others'.
void sample_cases(Row& row, size_t n, double& total_cost) {
  std::vector<size_t> by_cost(row.cases.size());
  for (size_t i = 0; i < by_cost.size(); ++i) by_cost[i] = i;
  std::stable_sort(by_cost.begin(), by_cost.end(), [&](size_t a, size_t b) { return row.costs[a] < row.costs[b]; });
  std::vector<bool> keep(row.cases.size(), false);
  for (size_t i = 0; i < n; ++i) keep[by_cost[n == 1 ? by_cost.size() - 1 : i * (by_cost.size() - 1) / (n - 1)]] = true;
  Row kept;
  for (size_t i = 0; i < row.cases.size(); ++i) {
    if (keep[i]) kept.cases.push_back(row.cases[i]), kept.costs.push_back(row.costs[i]);
    else total_cost -= row.costs[i];
  }
  row.cases = std::move(kept.cases), row.costs = std::move(kept.costs);
}

}  // namespace

std::function<std::vector<CaseResult>(const WorkUnit&)> suite_unit_runner(const SuiteOptions& o) {
  auto options = std::make_shared<SuiteOptions>(o);
  auto gens = std::make_shared<Generations>(*options);
  return [options, gens](const WorkUnit& u) {
    const OpSchema* s = find_op_schema(u.op);
    LOOM_REQUIRE(s, "conformance: no op '", u.op, "' is declared");
    naive::set_threads(u.threads);
    return run_cases(*s, u.dtype, *gens, u.cases, *options);
  };
}

std::vector<CaseResult> run_suite(const SuiteOptions& o) {
  const auto start = Clock::now();
  Generations gens(o);
  std::vector<Row> rows;
  double total_cost = 0;
  int64_t total_cases = 0;
  for (const OpSchema* s : op_schemas()) {
    if (!o.ops.empty() && std::find(o.ops.begin(), o.ops.end(), s->name) == o.ops.end()) continue;
    for (DType dt : provider_dtypes(*s, o)) {
      Row& row = rows.emplace_back();
      row.s = s, row.dtype = dt;
      const int n = gens.cases(*s, dt);
      const Generated& g = gens.of(*s, dt);
      for (int k = 0; k < n; ++k) {
        if (o.only_case >= 0 && k != o.only_case) continue;
        row.cases.push_back(k);
        const size_t plan = size_t(k) < g.plans.size() ? size_t(k) : gens.repeat()->first;
        row.costs.push_back(case_cost(*s, g.plans[plan].e) * (size_t(k) < g.plans.size() ? 1 : 3));
        total_cost += row.costs.back();
      }
      if (o.sample > 0 && row.cases.size() > size_t(o.sample)) sample_cases(row, size_t(o.sample), total_cost);
      row.pending = int(row.cases.size());
      total_cases += row.pending;
    }
  }
  int64_t done_cases = 0;
  double done_cost = 0;
  auto finished = [&](Row& row) {
    if (!o.progress) return;
    SuiteProgress p;
    p.op = row.s->name, p.dtype = row.dtype, p.cases = int(row.results.size()), p.seconds = row.seconds;
    for (const CaseResult& r : row.results)
      p.failed += r.status == CaseStatus::kFail, p.declined += r.status == CaseStatus::kDeclined;
    p.done = done_cases, p.total = total_cases, p.elapsed = seconds_since(start);
    if (done_cost > 0) p.remaining = p.elapsed * std::max(0.0, total_cost - done_cost) / done_cost;
    o.progress(p);
  };

  std::vector<CaseResult> results;
  if (o.jobs <= 1 || o.worker_command.empty() || total_cases <= 1) {
    for (Row& row : rows) {
      const auto row_start = Clock::now();
      row.results = run_cases(*row.s, row.dtype, gens, row.cases, o);
      row.seconds = seconds_since(row_start);
      done_cases += int64_t(row.cases.size());
      for (double c : row.costs) done_cost += c;
      finished(row);
      results.insert(results.end(), row.results.begin(), row.results.end());
    }
    return results;
  }

  // Over workers: units of consecutive cases of one row, about an eighth of a worker's share each, so that the
  // long rows (gemm's long K, attention) spread and the last units to finish are small.
  const double target = total_cost / (8.0 * double(o.jobs));
  std::vector<WorkUnit> units;
  for (size_t r = 0; r < rows.size(); ++r) {
    Row& row = rows[r];
    row.results.resize(row.cases.size());
    WorkUnit u;
    for (size_t i = 0; i < row.cases.size(); ++i) {
      u.cases.push_back(row.cases[i]);
      u.cost += row.costs[i];
      if (u.cost >= target || i + 1 == row.cases.size()) {
        u.op = row.s->name, u.dtype = row.dtype;
        units.push_back(std::move(u));
        u = WorkUnit{};
      }
    }
  }
  share_threads(units, total_cost);
  std::map<std::pair<std::string, DType>, size_t> row_of;
  for (size_t r = 0; r < rows.size(); ++r) row_of[{rows[r].s->name, rows[r].dtype}] = r;
  run_on_workers(units, o.worker_command, o.jobs, [&](const WorkUnit& u, std::vector<CaseResult> got, double seconds) {
    Row& row = rows[row_of.at({u.op, u.dtype})];
    for (CaseResult& r : got) {
      const auto at = std::find(row.cases.begin(), row.cases.end(), r.index);
      LOOM_CHECK(at != row.cases.end());
      row.results[size_t(at - row.cases.begin())] = std::move(r);
    }
    row.pending -= int(u.cases.size());
    row.seconds += seconds;
    done_cases += int64_t(u.cases.size());
    done_cost += u.cost;
    if (row.pending == 0) finished(row);
  });
  for (Row& row : rows) results.insert(results.end(), row.results.begin(), row.results.end());
  return results;
}

}  // namespace loom::conformance
