// Hugging Face tokenizer.json (byte-level BPE): the reader, merge-ranked BPE over token ids, added tokens.
#include "loom/data/hf_tokenizer.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <queue>
#include <sstream>
#include <nlohmann/json.hpp>

#include "data/bpe_merge.h"
#include "data/byte_level.h"
#include "loom/common/error.h"
#include "loom/io/json_file.h"
#include "loom/io/read_file.h"

namespace loom::data {
namespace {

using nlohmann::json;

// A key's value when present and not null, else nullptr.
const json* member(const json& object, const char* key) {
  if (!object.is_object()) return nullptr;
  auto it = object.find(key);
  return it == object.end() || it->is_null() ? nullptr : &*it;
}

}  // namespace

HfTokenizer::HfTokenizer(const std::string& path) : path_(path) {
  const std::string text = io::read_input_file(path, io::kMaxTokenizerFileBytes, "tokenizer");
  try {
    load(text);
  } catch (const json::exception& e) {  // a value of an unexpected JSON type where load reads it
    LOOM_THROW("tokenizer ", path, ": not a tokenizer.json of the expected shape: ", io::json_error_text(e));
  }
}

HfTokenizer::~HfTokenizer() = default;

void HfTokenizer::load(const std::string& text) {
  auto fail = [&](const auto&... what) { LOOM_THROW("tokenizer ", path_, ": ", what...); };
  // Nesting bounded before parsing (a file nested 200,000 levels deep overflowed the stack), repeated keys refused.
  const json doc = io::parse_json(text, "tokenizer " + path_);
  if (!doc.is_object()) fail("not a tokenizer.json (a JSON object with \"model\"), got ", io::json_excerpt(doc));
  // A field that must be a string when present: "" when absent, an error naming it when of another type.
  auto string_of = [&](const json& object, const char* key, const std::string& where) -> std::string {
    const json* v = member(object, key);
    if (!v) return "";
    if (!v->is_string()) fail(where, ".", key, " must be a string, got ", io::json_excerpt(*v));
    return v->get<std::string>();
  };
  if (const json* n = member(doc, "normalizer"))
    fail("normalizer ", io::json_excerpt(n->is_object() && n->contains("type") ? (*n)["type"] : *n), " is not supported");

  // --- model: the vocabulary and the merges
  const json* model = member(doc, "model");
  if (!model || !model->is_object()) fail("no \"model\" object");
  if (const json* type = member(*model, "type"); type && *type != "BPE")
    fail("model.type ", io::json_excerpt(*type), " is not supported (only byte-level \"BPE\")");
  if (const json* d = member(*model, "dropout"); d && !(d->is_number() && d->get<double>() == 0))
    fail("model.dropout ", io::json_excerpt(*d), " is not supported");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (const json* v = member(*model, key); v && !(v->is_string() && v->get<std::string>().empty()))
      fail("model.", key, " ", io::json_excerpt(*v), " is not supported");
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
    if (!id_json.is_number_integer() || (id_json.is_number_unsigned() && id_json.get<uint64_t>() > uint64_t(INT32_MAX)))
      fail("model.vocab: the id of ", io::json_excerpt(json(symbol)), " must be an integer from 0 to ", INT32_MAX - 1,
           ", got ", io::json_excerpt(id_json));
    std::string raw;  // the token's bytes: each stand-in character back to its byte
    for (size_t p = 0; p < symbol.size();) {
      size_t len;
      auto it = code_to_byte.find(detail::decode_stand_in(symbol, p, len));
      if (it == code_to_byte.end())
        fail("model.vocab: token ", io::json_excerpt(json(symbol)), " has a character outside the byte-level alphabet "
             "(not a byte-level BPE vocabulary)");
      raw += char(it->second);
      p += len;
    }
    const int64_t id = id_json.get<int64_t>();
    define(id, raw, "model.vocab token " + io::json_excerpt(json(symbol)));
    if (!ids_.emplace(raw, int32_t(id)).second) fail("model.vocab: token ", io::json_excerpt(json(symbol)), " appears twice");
  }
  for (int b = 0; b < 256; ++b) {
    auto it = ids_.find(std::string(1, char(b)));
    if (it == ids_.end())
      fail("model.vocab lacks the single byte ", b, " (", io::json_excerpt(json(byte_symbol[b])),
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
        fail("model.merges[", rank, "] ", io::json_excerpt(m), " is not \"first second\"");
      parts[0] = s.substr(0, space);
      parts[1] = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {  // ["a", "b"]
      parts[0] = m[0].get<std::string>();
      parts[1] = m[1].get<std::string>();
    } else {
      fail("model.merges[", rank, "] ", io::json_excerpt(m), " is neither \"first second\" nor [first, second]");
    }
    int32_t part_ids[2];
    std::string merged;
    for (int k = 0; k < 2; ++k) {
      auto it = vocab->find(parts[k]);
      if (it == vocab->end()) fail("model.merges[", rank, "] ", io::json_excerpt(m), ": ", io::json_excerpt(json(parts[k])),
                                   " is not in model.vocab");
      part_ids[k] = int32_t(it->get<int64_t>());
      merged += token_bytes_[size_t(part_ids[k])];
    }
    auto result = ids_.find(merged);
    if (result == ids_.end())
      fail("model.merges[", rank, "] ", io::json_excerpt(m), ": the merged token ", io::json_excerpt(json(parts[0] + parts[1])),
           " is not in model.vocab");
    merges_.emplace(detail::bpe_pair_key(part_ids[0], part_ids[1]), MergeRank{int32_t(rank), result->second});  // first one wins
  }

  // --- added tokens
  if (const json* added = member(doc, "added_tokens")) {
    if (!added->is_array()) fail("added_tokens is not a list");
    for (size_t i = 0; i < added->size(); ++i) {
      const json& t = (*added)[i];
      const json* id = member(t, "id");
      const json* content = member(t, "content");
      if (!id || !id->is_number_integer() || !content || !content->is_string() || content->get<std::string>().empty())
        fail("added_tokens[", i, "] lacks an integer \"id\" or a non-empty \"content\": ", io::json_excerpt(t));
      if (id->is_number_unsigned() && id->get<uint64_t>() > uint64_t(INT32_MAX))
        fail("added_tokens[", i, "]: id ", io::json_excerpt(*id), " is outside 0..", INT32_MAX - 1);
      for (const char* key : {"lstrip", "rstrip", "single_word"})
        if (const json* v = member(t, key); v && *v == true)
          fail("added_tokens[", i, "] (", io::json_excerpt(*content), "): ", key, " is not supported");
      const std::string c = content->get<std::string>();
      const json* special = member(t, "special");
      define(id->get<int64_t>(), c, "added_tokens[" + std::to_string(i) + "] (" + io::json_excerpt(*content) + ")");
      added_.push_back({c, int32_t(id->get<int64_t>()), special && special->is_boolean() && special->get<bool>()});
    }
  }
  for (size_t id = 0; id < defined.size(); ++id)
    if (!defined[id]) fail("no token has id ", id, " (ids must be 0..", defined.size() - 1, ", each a token)");
  // The trie of their contents (the first of two equal contents is the one found).
  for (size_t i = 0; i < added_.size(); ++i) {
    uint32_t node = 0;
    for (unsigned char ch : added_[i].content) {
      auto [it, fresh] = added_edges_.emplace(uint64_t(node) << 8 | ch, uint32_t(added_ending_.size()));
      if (fresh) added_ending_.push_back(-1);
      node = it->second;
    }
    if (added_ending_[node] < 0) added_ending_[node] = int32_t(i);
  }

  // --- pre-tokenizer: one regex split (ByteLevel's own GPT-2 pattern or a Split) and ByteLevel
  const json* pre = member(doc, "pre_tokenizer");
  if (!pre) fail("no pre_tokenizer (a byte-level BPE has a ByteLevel one)");
  std::vector<const json*> steps;
  if (!pre->is_object()) fail("pre_tokenizer must be an object, got ", io::json_excerpt(*pre));
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
    if (!step->is_object()) fail("pre_tokenizer step must be an object, got ", io::json_excerpt(*step));
    const std::string type = string_of(*step, "type", "pre_tokenizer");
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
      if (const json* b = member(*step, "behavior"); !b || *b != "Isolated")
        fail("pre_tokenizer Split: behavior ", b ? io::json_excerpt(*b) : "(none)", " is not supported (only "
             "\"Isolated\")");
      if (const json* inv = member(*step, "invert"); inv && *inv == true)
        fail("pre_tokenizer Split: invert true is not supported");
      if (byte_level) fail("pre_tokenizer: a Split after ByteLevel is not supported");
      if (!pattern.empty()) fail("pre_tokenizer: more than one regex split is not supported");
      pattern = regex->get<std::string>();
    } else {
      fail("pre_tokenizer type ", io::json_excerpt(json(type)), " is not supported (ByteLevel, Split, Sequence)");
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
    if (string_of(*post, "type", "post_processor") == "Sequence" && member(*post, "processors") &&
        (*post)["processors"].is_array())
      for (const json& p : (*post)["processors"]) processors.push_back(&p);
    else
      processors.push_back(post);
  }
  for (const json* p : processors) {
    if (!p->is_object() || string_of(*p, "type", "post_processor") != "TemplateProcessing") continue;
    const json* single = member(*p, "single");
    if (!single || !single->is_array() || single->empty()) continue;
    const json* first = member((*single)[0], "SpecialToken");
    if (!first) continue;
    const json* name = member(*first, "id");
    if (!name || !name->is_string() || (prompt_prefix_ = token_id(name->get<std::string>())) < 0)
      fail("post_processor: the special token ", name ? io::json_excerpt(*name) : "?", " is not a token");
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
  detail::bpe_by_rank(piece, byte_ids_, merges_, out);
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
  // Added tokens are found in one pass with the trie: at each position the longest one that starts there. The
  // trie's steps are bounded per text (added tokens that share long prefixes with it could make them many).
  const uint64_t budget = 64 * uint64_t(text.size()) + (uint64_t(1) << 24);
  uint64_t steps = 0;
  auto longest_at = [&](size_t at, size_t& length) -> const AddedToken* {
    const AddedToken* found = nullptr;
    uint32_t node = 0;
    for (size_t j = at; j < text.size(); ++j) {
      auto it = added_edges_.find(uint64_t(node) << 8 | static_cast<unsigned char>(text[j]));
      if (it == added_edges_.end()) break;
      LOOM_REQUIRE(++steps <= budget, "tokenizer ", path_, ": finding the added tokens in a text of ", text.size(),
                   " bytes exhausted its budget of ", budget, " steps (64 per byte plus 2^24) at byte ", at,
                   " (added tokens sharing long prefixes with the text)");
      node = it->second;
      const int32_t t = added_ending_[node];
      if (t >= 0 && !(added_[size_t(t)].special && special == SpecialTokens::kAsText))
        found = &added_[size_t(t)], length = j + 1 - at;
    }
    return found;
  };
  size_t start = 0;
  while (start < text.size()) {
    // The earliest added token in what is left (the longest where several start at one place).
    size_t best = std::string_view::npos, length = 0;
    const AddedToken* found = nullptr;
    for (size_t at = start; at < text.size() && !added_.empty(); ++at)
      if ((found = longest_at(at, length))) {
        best = at;
        break;
      }
    const std::string_view before = text.substr(start, found ? best - start : std::string_view::npos);
    std::vector<int32_t> ids = encode_ordinary(before);
    out.insert(out.end(), ids.begin(), ids.end());
    if (!found) break;
    out.push_back(found->id);
    start = best + length;
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
