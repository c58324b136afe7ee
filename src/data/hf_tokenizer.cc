// Hugging Face tokenizer.json (byte-level BPE): the reader, merge-ranked BPE over token ids, added tokens.
#include "loom/data/hf_tokenizer.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <queue>
#include <sstream>
#include <nlohmann/json.hpp>

#include "data/byte_level.h"
#include "loom/common/error.h"

namespace loom::data {
namespace {

using nlohmann::json;

uint64_t pair_key(int32_t left, int32_t right) { return uint64_t(uint32_t(left)) << 32 | uint32_t(right); }

// A key's value when present and not null, else nullptr.
const json* member(const json& object, const char* key) {
  if (!object.is_object()) return nullptr;
  auto it = object.find(key);
  return it == object.end() || it->is_null() ? nullptr : &*it;
}

}  // namespace

HfTokenizer::HfTokenizer(const std::string& path) : path_(path) {
  std::error_code ec;
  LOOM_REQUIRE(std::filesystem::is_regular_file(path, ec), "tokenizer ", path,
               std::filesystem::exists(path, ec) ? " is not a file" : " not found");
  std::ifstream in(path, std::ios::binary);
  LOOM_REQUIRE(in, "tokenizer ", path, " cannot be read");
  std::ostringstream ss;
  ss << in.rdbuf();
  try {
    load(ss.str());
  } catch (const json::exception& e) {  // a value of an unexpected JSON type where load reads it
    LOOM_THROW("tokenizer ", path, ": not a tokenizer.json of the expected shape (", e.what(), ")");
  }
}

HfTokenizer::~HfTokenizer() = default;

void HfTokenizer::load(const std::string& text) {
  auto fail = [&](const auto&... what) { LOOM_THROW("tokenizer ", path_, ": ", what...); };
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::exception& e) {
    fail("not valid JSON (", e.what(), ")");
  }
  if (!doc.is_object()) fail("not a tokenizer.json (a JSON object with \"model\")");
  if (member(doc, "normalizer")) fail("normalizer ", doc["normalizer"].value("type", "?"), " is not supported");

  // --- model: the vocabulary and the merges
  const json* model = member(doc, "model");
  if (!model || !model->is_object()) fail("no \"model\" object");
  if (const json* type = member(*model, "type"); type && *type != "BPE")
    fail("model.type ", type->dump(), " is not supported (only byte-level \"BPE\")");
  if (const json* d = member(*model, "dropout"); d && !(d->is_number() && d->get<double>() == 0))
    fail("model.dropout ", d->dump(), " is not supported");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (const json* v = member(*model, key); v && !(v->is_string() && v->get<std::string>().empty()))
      fail("model.", key, " ", v->dump(), " is not supported");
  if (const json* v = member(*model, "ignore_merges")) {
    if (!v->is_boolean()) fail("model.ignore_merges is not true or false");
    ignore_merges_ = v->get<bool>();
  }
  const json* vocab = member(*model, "vocab");
  if (!vocab || !vocab->is_object() || vocab->empty()) fail("model.vocab is not an object of token -> id");

  std::string byte_symbol[256];
  std::unordered_map<uint32_t, uint8_t> code_to_byte;
  detail::make_byte_symbols(byte_symbol, code_to_byte);
  std::vector<bool> defined;
  auto define = [&](int64_t id, std::string bytes, const std::string& where) {
    if (id < 0 || id > INT32_MAX - 1) fail(where, " has id ", id, ", outside 0..", INT32_MAX - 1);
    if (size_t(id) >= token_bytes_.size()) {
      token_bytes_.resize(size_t(id) + 1);
      defined.resize(size_t(id) + 1, false);
    }
    if (defined[size_t(id)] && token_bytes_[size_t(id)] != bytes) fail(where, ": id ", id, " is given twice");
    defined[size_t(id)] = true;
    token_bytes_[size_t(id)] = std::move(bytes);
  };
  for (const auto& [symbol, id_json] : vocab->items()) {
    if (!id_json.is_number_integer()) fail("model.vocab: the id of ", json(symbol).dump(), " is not an integer");
    std::string raw;  // the token's bytes: each stand-in character back to its byte
    for (size_t p = 0; p < symbol.size();) {
      size_t len;
      auto it = code_to_byte.find(detail::decode_stand_in(symbol, p, len));
      if (it == code_to_byte.end())
        fail("model.vocab: token ", json(symbol).dump(), " has a character outside the byte-level alphabet "
             "(not a byte-level BPE vocabulary)");
      raw += char(it->second);
      p += len;
    }
    const int64_t id = id_json.get<int64_t>();
    define(id, raw, "model.vocab token " + json(symbol).dump());
    if (!ids_.emplace(raw, int32_t(id)).second) fail("model.vocab: token ", json(symbol).dump(), " appears twice");
  }
  for (int b = 0; b < 256; ++b) {
    auto it = ids_.find(std::string(1, char(b)));
    if (it == ids_.end())
      fail("model.vocab lacks the single byte ", b, " (", json(byte_symbol[b]).dump(),
           "): byte-level BPE needs all 256");
    byte_ids_[b] = it->second;
  }

  const json* merges = member(*model, "merges");
  if (!merges || !merges->is_array()) fail("model.merges is not a list");
  for (size_t rank = 0; rank < merges->size(); ++rank) {
    const json& m = (*merges)[rank];
    std::string parts[2];
    if (m.is_string()) {  // "a b"
      const std::string s = m.get<std::string>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || space == 0 || space + 1 >= s.size() || s.find(' ', space + 1) != s.npos)
        fail("model.merges[", rank, "] ", m.dump(), " is not \"first second\"");
      parts[0] = s.substr(0, space);
      parts[1] = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {  // ["a", "b"]
      parts[0] = m[0].get<std::string>();
      parts[1] = m[1].get<std::string>();
    } else {
      fail("model.merges[", rank, "] ", m.dump().substr(0, 80), " is neither \"first second\" nor [first, second]");
    }
    int32_t part_ids[2];
    std::string merged;
    for (int k = 0; k < 2; ++k) {
      auto it = vocab->find(parts[k]);
      if (it == vocab->end()) fail("model.merges[", rank, "] ", m.dump(), ": ", json(parts[k]).dump(),
                                   " is not in model.vocab");
      part_ids[k] = int32_t(it->get<int64_t>());
      merged += token_bytes_[size_t(part_ids[k])];
    }
    auto result = ids_.find(merged);
    if (result == ids_.end())
      fail("model.merges[", rank, "] ", m.dump(), ": the merged token ", json(parts[0] + parts[1]).dump(),
           " is not in model.vocab");
    merges_.emplace(pair_key(part_ids[0], part_ids[1]), Merge{int32_t(rank), result->second});  // first one wins
  }

  // --- added tokens
  if (const json* added = member(doc, "added_tokens")) {
    if (!added->is_array()) fail("added_tokens is not a list");
    for (size_t i = 0; i < added->size(); ++i) {
      const json& t = (*added)[i];
      const json* id = member(t, "id");
      const json* content = member(t, "content");
      if (!id || !id->is_number_integer() || !content || !content->is_string() || content->get<std::string>().empty())
        fail("added_tokens[", i, "] lacks an integer \"id\" or a non-empty \"content\"");
      for (const char* key : {"lstrip", "rstrip", "single_word"})
        if (const json* v = member(t, key); v && *v == true)
          fail("added_tokens[", i, "] (", content->dump(), "): ", key, " is not supported");
      const std::string c = content->get<std::string>();
      const json* special = member(t, "special");
      define(id->get<int64_t>(), c, "added_tokens[" + std::to_string(i) + "] (" + content->dump() + ")");
      added_.push_back({c, int32_t(id->get<int64_t>()), special && special->is_boolean() && special->get<bool>()});
    }
  }
  for (size_t id = 0; id < defined.size(); ++id)
    if (!defined[id]) fail("no token has id ", id, " (ids must be 0..", defined.size() - 1, ", each a token)");
  // Longest first: where two added tokens start at one place, the longer one is taken.
  std::stable_sort(added_.begin(), added_.end(),
                   [](const AddedToken& a, const AddedToken& b) { return a.content.size() > b.content.size(); });

  // --- pre-tokenizer: one regex split (ByteLevel's own GPT-2 pattern or a Split) and ByteLevel
  const json* pre = member(doc, "pre_tokenizer");
  if (!pre) fail("no pre_tokenizer (a byte-level BPE has a ByteLevel one)");
  std::vector<const json*> steps;
  if (member(*pre, "type") && (*pre)["type"] == "Sequence") {
    const json* list = member(*pre, "pretokenizers");
    if (!list || !list->is_array()) fail("pre_tokenizer Sequence has no \"pretokenizers\" list");
    for (const json& p : *list) steps.push_back(&p);
  } else {
    steps.push_back(pre);
  }
  std::string pattern;
  bool byte_level = false;
  for (const json* step : steps) {
    const std::string type = step->value("type", "");
    if (type == "ByteLevel") {
      if (const json* v = member(*step, "add_prefix_space"); v && *v == true)
        fail("pre_tokenizer ByteLevel: add_prefix_space true is not supported");
      const json* use_regex = member(*step, "use_regex");
      if (!use_regex || *use_regex == true) {
        if (!pattern.empty()) fail("pre_tokenizer: more than one regex split is not supported");
        pattern = Pretokenizer::kGPT2Pattern;
      }
      byte_level = true;
    } else if (type == "Split") {
      const json* p = member(*step, "pattern");
      const json* regex = p ? member(*p, "Regex") : nullptr;
      if (!regex || !regex->is_string()) fail("pre_tokenizer Split: only a {\"Regex\": ...} pattern is supported");
      if (step->value("behavior", "") != "Isolated")
        fail("pre_tokenizer Split: behavior ", step->value("behavior", json()).dump(), " is not supported (only "
             "\"Isolated\")");
      if (const json* inv = member(*step, "invert"); inv && *inv == true)
        fail("pre_tokenizer Split: invert true is not supported");
      if (byte_level) fail("pre_tokenizer: a Split after ByteLevel is not supported");
      if (!pattern.empty()) fail("pre_tokenizer: more than one regex split is not supported");
      pattern = regex->get<std::string>();
    } else {
      fail("pre_tokenizer type ", json(type).dump(), " is not supported (ByteLevel, Split, Sequence)");
    }
  }
  if (!byte_level) fail("pre_tokenizer has no ByteLevel step: not a byte-level BPE");
  if (pattern.empty()) fail("pre_tokenizer splits by no regex (ByteLevel without use_regex and no Split)");
  try {
    pretokenizer_ = Pretokenizer(pattern);
  } catch (const Error& e) {
    fail(e.what());
  }

  // --- the tokens around a text: the post-processor's first special token; the end-of-text tokens
  std::vector<const json*> processors;
  if (const json* post = member(doc, "post_processor")) {
    if (post->value("type", "") == "Sequence" && member(*post, "processors") && (*post)["processors"].is_array())
      for (const json& p : (*post)["processors"]) processors.push_back(&p);
    else
      processors.push_back(post);
  }
  for (const json* p : processors) {
    if (p->value("type", "") != "TemplateProcessing") continue;
    const json* single = member(*p, "single");
    if (!single || !single->is_array() || single->empty()) continue;
    const json* first = member((*single)[0], "SpecialToken");
    if (!first) continue;
    const json* name = member(*first, "id");
    if (!name || !name->is_string() || (prompt_prefix_ = token_id(name->get<std::string>())) < 0)
      fail("post_processor: the special token ", name ? name->dump() : "?", " is not a token");
  }
  for (const char* end : {"<|endoftext|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>"})
    if (int32_t id = token_id(end); id >= 0) end_tokens_.push_back(id);
  document_token_ = prompt_prefix_ >= 0 ? prompt_prefix_ : token_id("<|endoftext|>");
  if (document_token_ < 0)
    fail("no token to put in front of documents: neither a post_processor that opens with a special token nor "
         "<|endoftext|>");
}

int32_t HfTokenizer::token_id(std::string_view bytes) const {
  for (const AddedToken& t : added_)
    if (t.content == bytes) return t.id;
  auto it = ids_.find(bytes);
  return it == ids_.end() ? -1 : it->second;
}

void HfTokenizer::bpe(std::string_view piece, std::vector<int32_t>& out) const {
  if (ignore_merges_)
    if (auto it = ids_.find(piece); it != ids_.end()) {
      out.push_back(it->second);
      return;
    }
  // Parts as a linked list by start offset (next[s]: where the part at s ends; id[s]: its token); a heap of candidate
  // merges by (rank, start): the lowest rank first, the leftmost among equals, as Hugging Face's BPE. A candidate is
  // stale once either part has merged elsewhere: the part at `start` then no longer ends at `mid`, or the one at
  // `mid` no longer at `end`.
  const uint32_t n = uint32_t(piece.size());
  std::vector<uint32_t> next(n), prev(n);
  std::vector<int32_t> id(n);
  std::vector<bool> alive(n, true);
  struct Candidate {
    int32_t rank;
    uint32_t start, mid, end;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : start > o.start; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  auto push = [&](uint32_t start) {
    const uint32_t mid = next[start];
    if (mid >= n) return;
    if (auto it = merges_.find(pair_key(id[start], id[mid])); it != merges_.end())
      heap.push({it->second.rank, start, mid, next[mid]});
  };
  for (uint32_t i = 0; i < n; ++i) {
    next[i] = i + 1;
    prev[i] = i - 1;  // wraps for i = 0: never read
    id[i] = byte_ids_[static_cast<unsigned char>(piece[i])];
  }
  for (uint32_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    if (!alive[c.start] || next[c.start] != c.mid || !alive[c.mid] || next[c.mid] != c.end) continue;
    id[c.start] = merges_.at(pair_key(id[c.start], id[c.mid])).merged;
    alive[c.mid] = false;
    next[c.start] = c.end;
    if (c.end < n) prev[c.end] = c.start;
    if (c.start > 0) push(prev[c.start]);
    push(c.start);
  }
  for (uint32_t s = 0; s < n; s = next[s]) out.push_back(id[s]);
}

std::vector<int32_t> HfTokenizer::encode_ordinary(std::string_view text) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3);
  for (std::string_view piece : pretokenizer_.split(text))
    cache_.append(piece, out, [&](std::string_view p) {
      std::vector<int32_t> ids;
      bpe(p, ids);
      return ids;
    });
  return out;
}

std::vector<int32_t> HfTokenizer::encode(std::string_view text, SpecialTokens special) const {
  std::vector<int32_t> out;
  size_t start = 0;
  while (start < text.size()) {
    // The earliest added token in what is left (the longest where several start at one place).
    size_t best = std::string_view::npos;
    const AddedToken* found = nullptr;
    for (const AddedToken& t : added_) {
      if (t.special && special == SpecialTokens::kAsText) continue;
      const size_t at = text.find(t.content, start);
      if (at < best) best = at, found = &t;
    }
    const std::string_view before = text.substr(start, found ? best - start : std::string_view::npos);
    std::vector<int32_t> ids = encode_ordinary(before);
    out.insert(out.end(), ids.begin(), ids.end());
    if (!found) break;
    out.push_back(found->id);
    start = best + found->content.size();
  }
  return out;
}

std::string HfTokenizer::decode(std::span<const int32_t> tokens) const {
  std::string out;
  for (int32_t t : tokens) {
    LOOM_REQUIRE(t >= 0 && t < int32_t(token_bytes_.size()), "tokenizer ", path_, ": decode: token ", t,
                 " outside the vocabulary of ", token_bytes_.size(), " (ids 0..", token_bytes_.size() - 1, ")");
    out += token_bytes_[size_t(t)];
  }
  return out;
}

}  // namespace loom::data
