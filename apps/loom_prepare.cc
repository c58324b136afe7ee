// loom-prepare: tokenizes text files with GPT-2's or LLaMA-3's tokenizer into llm.c token shards, a validation split
// and train shards.
//
//   loom-prepare --input tinyshakespeare.txt --output-dir data/tinyshakespeare --val-fraction 0.1
//   loom-prepare --input tinyshakespeare.txt --tokenizer llama3 --tokenizer-path Meta-Llama-3-8B/tokenizer.model
//
// Every document starts with the tokenizer's document token: GPT-2's end-of-text (llm.c's convention), LLaMA-3's
// <|begin_of_text|> (as Meta's and llm.c's LLaMA-3 data preparation do). Shards hold uint16 tokens when the
// tokenizer's ids fit (GPT-2), else uint32 (LLaMA-3: llm.c's uint32 format). A document is one input file, or with
// --paragraph-documents each "\n\n"-separated section of a file (as llm.c's tinyshakespeare.py does). The first
// val-fraction of all tokens (or exactly --val-tokens) becomes <name>_val_000000.bin, the rest
// <name>_train_NNNNNN.bin in shards of at most --shard-tokens. llm.c's tinyshakespeare split is
// `--paragraph-documents --val-tokens 32768`.
//
// JSON Lines (as Hugging Face datasets export them): an input named *.jsonl or *.ndjson, or every input when
// --text-field is given, holds one JSON object per line whose --text-field (default "text") is one document.
// Several inputs with --weights: the tokens are mixed in those proportions (each input's documents in order,
// repeated from its start when its share needs more than it has), its documents interleaved evenly through the
// shards; the total stays the inputs' total.
//
//   loom-prepare --input web.jsonl --input code.jsonl --text-field content --weights 3,1 --name mix
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cli/cli.h"
#include "loom/io/input_guard.h"
#include "loom/io/json_file.h"
#include "loom/io/read_file.h"
#include "loom/common/error.h"
#include "loom/data/token_file.h"
#include "loom/data/tokenizer.h"

namespace fs = std::filesystem;

namespace {

// An input named by a bare file name is also looked for in $LOOM_DATA_DIR and in shared/data beside the repository
// (found by walking up from the working directory and from this executable's directory).
std::string resolve_input(const std::string& name) {
  std::vector<fs::path> tried{fs::path(name)};
  const bool bare = fs::path(name).filename() == fs::path(name);
  if (bare) {
    if (const char* d = std::getenv("LOOM_DATA_DIR"); d && *d) tried.push_back(fs::path(d) / name);
    std::vector<fs::path> starts{fs::current_path()};
    std::error_code ec;
    fs::path exe = fs::read_symlink("/proc/self/exe", ec);
    if (!ec) starts.push_back(exe.parent_path());
    for (fs::path dir : starts) {
      for (; !dir.empty(); dir = dir.parent_path()) {
        tried.push_back(dir / "shared" / "data" / name);
        if (dir == dir.root_path()) break;
      }
    }
  }
  std::string looked;
  std::vector<fs::path> seen;
  for (const auto& p : tried) {
    if (std::find(seen.begin(), seen.end(), p) != seen.end()) continue;
    seen.push_back(p);
    std::error_code ec;
    if (fs::is_regular_file(p, ec)) return p.string();
    looked += (looked.empty() ? " " : ", ") + p.string();
  }
  LOOM_THROW("loom-prepare: input file ", name, " not found; looked at", looked,
             bare ? " (set LOOM_DATA_DIR to the directory that holds it)" : "");
}

std::string megabytes(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f MB", bytes / 1e6);
  return buf;
}

// The shards an earlier run wrote into `dir` under `name`: <name>_val_NNNNNN.bin and <name>_train_NNNNNN.bin, sorted.
std::vector<std::string> existing_shards(const std::string& dir, const std::string& name) {
  std::vector<std::string> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string file = it->path().filename().string();
    for (const char* split : {"_val_", "_train_"}) {
      const std::string prefix = name + split;
      const std::string rest = file.size() > prefix.size() ? file.substr(prefix.size()) : "";
      if (file.rfind(prefix, 0) == 0 && rest.size() == 10 && rest.substr(6) == ".bin" &&
          std::all_of(rest.begin(), rest.begin() + 6, [](char c) { return c >= '0' && c <= '9'; }))
        out.push_back(it->path().string());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

// The documents of a JSON Lines input: each non-blank line one object whose `field` is a string.
std::vector<std::string> jsonl_documents(const std::string& text, const std::string& path, const std::string& field) {
  std::vector<std::string> docs;
  size_t start = 0;
  for (int64_t line = 1; start < text.size(); ++line) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::string_view row(text.data() + start, end - start);
    start = end + 1;
    if (!row.empty() && row.back() == '\r') row.remove_suffix(1);
    if (row.find_first_not_of(" \t") == std::string_view::npos) continue;
    const std::string where = "--input " + path + ":" + std::to_string(line);
    const nlohmann::json j = loom::io::parse_json(row, where);
    LOOM_REQUIRE(j.is_object(), where, ": a JSON Lines row must be an object, got ", loom::io::json_excerpt(j));
    const auto it = j.find(field);
    LOOM_REQUIRE(it != j.end(), where, ": no field \"", field, "\" (--text-field; the row has ",
                 j.empty() ? std::string("no fields") : "\"" + j.begin().key() + "\"" + (j.size() > 1 ? ", ..." : ""),
                 ")");
    LOOM_REQUIRE(it->is_string(), where, ": field \"", field, "\" must be a string, got ",
                 loom::io::json_excerpt(*it));
    docs.push_back(it->get<std::string>());
  }
  return docs;
}

bool is_jsonl_name(const std::string& path) {
  const std::string ext = fs::path(path).extension().string();
  return ext == ".jsonl" || ext == ".ndjson";
}

// One input's tokens, each document starting with the tokenizer's document token at one of `starts`.
struct InputTokens {
  std::vector<int32_t> tokens;
  std::vector<size_t> starts;
  size_t document_end(size_t d) const { return d + 1 < starts.size() ? starts[d + 1] : tokens.size(); }
};

// The inputs' documents mixed by weight: input i gets round(total * w_i / sum w) tokens (whole documents, in order,
// from its start again when it runs out), and the next document always comes from the input furthest behind its
// share. Returns the mixed tokens; `passes` gets how many times over each input was read.
std::vector<int32_t> mix_by_weight(const std::vector<InputTokens>& in, const std::vector<double>& weights,
                                   std::vector<double>& passes) {
  uint64_t total = 0;
  double weight_sum = 0;
  for (size_t i = 0; i < in.size(); ++i) total += in[i].tokens.size(), weight_sum += weights[i];
  std::vector<uint64_t> quota(in.size()), taken(in.size(), 0);
  std::vector<size_t> next(in.size(), 0);
  for (size_t i = 0; i < in.size(); ++i) quota[i] = uint64_t(std::llround(double(total) * weights[i] / weight_sum));
  std::vector<int32_t> out;
  out.reserve(total);
  passes.assign(in.size(), 0);
  for (;;) {
    size_t pick = in.size();
    double behind = 2;
    for (size_t i = 0; i < in.size(); ++i) {
      if (taken[i] >= quota[i] || in[i].starts.empty()) continue;
      const double share = double(taken[i]) / double(quota[i]);
      if (share < behind) behind = share, pick = i;
    }
    if (pick == in.size()) break;
    const InputTokens& src = in[pick];
    const size_t d = next[pick] % src.starts.size();
    out.insert(out.end(), src.tokens.begin() + ptrdiff_t(src.starts[d]),
               src.tokens.begin() + ptrdiff_t(src.document_end(d)));
    taken[pick] += src.document_end(d) - src.starts[d];
    ++next[pick];
  }
  for (size_t i = 0; i < in.size(); ++i)
    passes[i] = in[i].tokens.empty() ? 0 : double(taken[i]) / double(in[i].tokens.size());
  return out;
}

std::vector<std::string_view> split_documents(std::string_view text, bool paragraphs) {
  if (!paragraphs) return {text};
  // Like llm.c: sections of text.split("\n\n"), each but the last keeping its "\n\n".
  std::vector<std::string_view> docs;
  size_t start = 0;
  for (size_t pos; (pos = text.find("\n\n", start)) != std::string_view::npos; start = pos + 2)
    docs.push_back(text.substr(start, pos + 2 - start));
  docs.push_back(text.substr(start));
  return docs;
}

}  // namespace

int main(int argc, char** argv) {
  loom::io::protect_inputs();  // no output of this run replaces a file it read
  CLI::App app{"Tokenizes text files with GPT-2's or LLaMA-3's tokenizer into llm.c token shards (train and "
               "validation)."};
  std::vector<std::string> inputs;
  std::string output_dir, name, tokenizer_name = "gpt2", tokenizer_path, width_name;
  double val_fraction = 0.1;
  int64_t val_tokens = -1;
  int64_t shard_tokens = 100'000'000;
  bool paragraph_documents = false, overwrite = false;
  std::string text_field = "text";
  std::vector<double> weights;
  app.add_option("-i,--input", inputs, "text file(s); a bare name is also looked for in $LOOM_DATA_DIR and "
                                       "shared/data beside the repository")
      ->required();
  app.add_option("-o,--output-dir", output_dir, "where the shards go (default data/<name>)");
  app.add_option("--name", name, "shard file prefix (default: the first input's stem)");
  app.add_option("--val-fraction", val_fraction, "fraction of tokens, from the start, for validation")
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {  // NaN passes CLI11's Range (every comparison with it is false)
            char* end = nullptr;
            const double d = std::strtod(v.c_str(), &end);
            return end != v.c_str() && !(d >= 0.0 && d <= 1.0) ? "must be between 0 and 1, got " + v : "";
          },
          "[0, 1]"));
  app.add_option("--val-tokens", val_tokens, "exact number of validation tokens (overrides --val-fraction)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--shard-tokens", shard_tokens, "most tokens per train shard")->check(CLI::PositiveNumber);
  app.add_option("--tokenizer", tokenizer_name, "gpt2 or llama3")
      ->capture_default_str()
      ->check(CLI::IsMember({"gpt2", "llama3"}));
  app.add_option("--tokenizer-path,--vocab-dir", tokenizer_path,
                 "a Hugging Face tokenizer.json (byte-level BPE, whatever --tokenizer says); gpt2: the directory with "
                 "encoder.json and vocab.bpe (default $LOOM_CACHE_DIR/gpt2 or ~/.cache/loom/gpt2); llama3: Meta's "
                 "tokenizer.model (required)");
  app.add_option("--token-width", width_name,
                 "u16 or u32 (default: u16 when the tokenizer's ids fit, as GPT-2's; else u32, as LLaMA-3's)")
      ->check(CLI::IsMember({"u16", "u32"}));
  app.add_flag("--paragraph-documents", paragraph_documents,
               "each \"\\n\\n\"-separated section is a document (llm.c's tinyshakespeare convention)");
  auto* text_field_opt = app.add_option("--text-field", text_field,
                 "read the inputs as JSON Lines (one object per line, as Hugging Face datasets export them) and take "
                 "this field of each as a document (default \"text\"; inputs named *.jsonl or *.ndjson are read so "
                 "without the flag)");
  app.add_option("--weights", weights,
                 "mix the inputs' tokens in these proportions, one weight per --input in order (3,1: three quarters "
                 "from the first); an input's documents repeat when its share needs more than it has")
      ->delimiter(',')
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            char* end = nullptr;
            const double d = std::strtod(v.c_str(), &end);
            return end != v.c_str() && !(d > 0 && std::isfinite(d)) ? "a weight must be a finite number > 0, got " + v
                                                                      : "";
          },
          "> 0"));
  app.add_flag("--overwrite", overwrite,
               "replace the shards of an earlier run in --output-dir (its <name>_val_/<name>_train_ files, all of "
               "them); without it such a run is refused before it starts");
  loom::cli::output_options(app, {"--output-dir"});
  if (int rc = loom::cli::parse(app, "loom-prepare", argc, argv); rc >= 0) return rc;

  return loom::cli::run("loom-prepare", [&] {
    LOOM_REQUIRE(weights.empty() || weights.size() == inputs.size(), "loom-prepare: --weights gives ", weights.size(),
                 " weight(s) for ", inputs.size(), " --input file(s); give one per input, in their order");
    std::vector<std::string> paths;
    for (const auto& in : inputs) paths.push_back(resolve_input(in));
    for (const auto& path : paths) loom::io::note_input(path);
    if (name.empty()) name = fs::path(paths[0]).stem().string();
    if (output_dir.empty()) output_dir = (fs::path("data") / name).string();
    const std::vector<std::string> earlier = existing_shards(output_dir, name);
    LOOM_REQUIRE(earlier.empty() || overwrite, "loom-prepare: ", output_dir, " already holds ", earlier.size(),
                 " shard(s) named ", name, "_* (", earlier.front(), earlier.size() > 1 ? ", ..." : "",
                 "); pass --overwrite to replace them, or choose another --output-dir or --name");
    // Before the tokenizing: no shard this run replaces or removes is one of its inputs.
    for (const std::string& old : earlier) loom::io::check_output_file(old);

    const std::unique_ptr<loom::data::Tokenizer> tokenizer = loom::data::load_tokenizer(tokenizer_name, tokenizer_path);
    const bool ids_fit_u16 = tokenizer->vocab_size() <= 65536;
    if (width_name.empty()) width_name = ids_fit_u16 ? "u16" : "u32";
    LOOM_REQUIRE(width_name == "u32" || ids_fit_u16, "loom-prepare: --token-width u16 cannot hold the ",
                 tokenizer->name(), " tokenizer's ids (a vocabulary of ", tokenizer->vocab_size(),
                 "); use u32, or leave --token-width out");
    const auto width = width_name == "u32" ? loom::data::TokenWidth::kU32 : loom::data::TokenWidth::kU16;
    uint64_t total_bytes = 0;
    for (const auto& p : paths) total_bytes += fs::file_size(p);
    std::printf("loom-prepare: tokenizing %zu file(s), %s, with the %s tokenizer into %s shards\n", paths.size(),
                megabytes(double(total_bytes)).c_str(), tokenizer->name().c_str(), width_name.c_str());

    uint64_t bytes_done = 0, last_report = 0;
    const uint64_t report_every = std::max<uint64_t>(total_bytes / 10, 1);
    int64_t documents = 0;
    size_t tokens_so_far = 0;
    std::vector<InputTokens> per_input(paths.size());
    for (size_t i = 0; i < paths.size(); ++i) {
      const std::string& path = paths[i];
      InputTokens& out = per_input[i];
      const std::string text = loom::io::read_input_file(path, loom::io::kMaxDataFileBytes, "--input");
      LOOM_REQUIRE(!text.empty(), "loom-prepare: input file ", path, " is empty");
      const bool jsonl = text_field_opt->count() > 0 || is_jsonl_name(path);
      std::vector<std::string> rows;
      std::vector<std::string_view> docs;
      if (jsonl) {
        rows = jsonl_documents(text, path, text_field);
        LOOM_REQUIRE(!rows.empty(), "loom-prepare: input file ", path, " holds no JSON Lines row");
        for (const std::string& row : rows)
          for (std::string_view doc : split_documents(row, paragraph_documents)) docs.push_back(doc);
      } else {
        docs = split_documents(text, paragraph_documents);
      }
      for (std::string_view doc : docs) {
        out.starts.push_back(out.tokens.size());
        out.tokens.push_back(tokenizer->document_token());
        ++documents;
        // Chunks encode to exactly the tokens of the whole document, and give progress on big files.
        for (std::string_view chunk : loom::data::split_for_encoding(doc, 1 << 18)) {
          auto ids = tokenizer->encode(chunk);
          out.tokens.insert(out.tokens.end(), ids.begin(), ids.end());
          bytes_done += chunk.size();
          if (bytes_done - last_report >= report_every) {
            last_report = bytes_done;
            std::printf("loom-prepare: %s / %s, %zu tokens\n", megabytes(double(bytes_done)).c_str(),
                        megabytes(double(total_bytes)).c_str(), tokens_so_far + out.tokens.size());
            std::fflush(stdout);
          }
        }
      }
      tokens_so_far += out.tokens.size();
      std::printf("loom-prepare: done %s (%zu tokens so far%s)\n", path.c_str(), tokens_so_far,
                  jsonl ? (", JSON Lines field \"" + text_field + "\"").c_str() : "");
    }
    std::vector<int32_t> tokens;
    if (weights.empty()) {
      tokens.reserve(tokens_so_far);
      for (InputTokens& in : per_input) {
        tokens.insert(tokens.end(), in.tokens.begin(), in.tokens.end());
        in = InputTokens{};
      }
    } else {
      std::vector<double> passes;
      tokens = mix_by_weight(per_input, weights, passes);
      double weight_sum = 0;
      for (double w : weights) weight_sum += w;
      for (size_t i = 0; i < paths.size(); ++i)
        std::printf("loom-prepare: mixture: %s weight %g (%.1f%%): %.0f tokens, %.2f passes over its %zu\n",
                    paths[i].c_str(), weights[i], 100.0 * weights[i] / weight_sum,
                    passes[i] * double(per_input[i].tokens.size()), passes[i], per_input[i].tokens.size());
    }

    const int64_t total = int64_t(tokens.size());
    const int64_t val_count =
        val_tokens >= 0 ? val_tokens : int64_t(std::llround(double(total) * val_fraction));
    LOOM_REQUIRE(val_count < total, "loom-prepare: ", val_count, " validation tokens leave none of the ", total,
                 " for training");
    fs::create_directories(output_dir);
    std::vector<std::pair<std::string, int64_t>> written;
    auto shard_path = [&](const char* split, int64_t index) {
      char suffix[32];
      std::snprintf(suffix, sizeof(suffix), "_%s_%06lld.bin", split, static_cast<long long>(index));
      return (fs::path(output_dir) / (name + suffix)).string();
    };
    std::span<const int32_t> all(tokens);
    if (val_count > 0) {
      const std::string path = shard_path("val", 0);
      loom::data::write_token_file(path, all.first(size_t(val_count)), width);
      written.emplace_back(path, val_count);
    }
    int64_t shard = 0;
    for (int64_t start = val_count; start < total; start += shard_tokens, ++shard) {
      const int64_t n = std::min(shard_tokens, total - start);
      const std::string path = shard_path("train", shard);
      loom::data::write_token_file(path, all.subspan(size_t(start), size_t(n)), width);
      written.emplace_back(path, n);
    }

    // --overwrite: an earlier run's shards this one did not write again (it had more) would join a glob of these.
    for (const std::string& old : earlier)
      if (std::none_of(written.begin(), written.end(), [&](const auto& w) { return w.first == old; })) {
        loom::io::check_output_file(old);
        fs::remove(old);
        std::printf("loom-prepare: removed %s (an earlier run's shard, --overwrite)\n", old.c_str());
      }

    std::printf("loom-prepare: %lld documents, %lld tokens: val %lld, train %lld\n", static_cast<long long>(documents),
                static_cast<long long>(total), static_cast<long long>(val_count),
                static_cast<long long>(total - val_count));
    for (const auto& [path, n] : written)
      std::printf("  wrote %s (%lld tokens)\n", path.c_str(), static_cast<long long>(n));
  });
}
