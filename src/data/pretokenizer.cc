// The regex pre-tokenizer over PCRE2 (8-bit code units, UTF, Unicode properties, JIT).
#include "loom/data/pretokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <cstdint>

#include "loom/common/error.h"

namespace loom::data {
namespace {

// The work budget of one split (see split): steps of PCRE2's match limit per byte of text, and a base for short texts.
constexpr uint64_t kMatchStepsPerByte = 64;
constexpr uint64_t kMatchStepsBase = uint64_t(1) << 24;

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  if (pcre2_get_error_message(code, buf, sizeof buf) < 0) return "PCRE2 error " + std::to_string(code);
  return reinterpret_cast<const char*>(buf);
}

// Byte length of the valid UTF-8 character at text[pos], or 0 for an invalid byte (a bad lead or continuation byte,
// a truncated sequence, an overlong form, a surrogate, a code point above U+10FFFF: what PCRE2 rejects).
size_t utf8_length(std::string_view text, size_t pos) {
  const auto b0 = static_cast<unsigned char>(text[pos]);
  if (b0 < 0x80) return 1;
  size_t n;
  uint32_t cp;
  if ((b0 & 0xE0) == 0xC0) n = 2, cp = b0 & 0x1F;
  else if ((b0 & 0xF0) == 0xE0) n = 3, cp = b0 & 0x0F;
  else if ((b0 & 0xF8) == 0xF0) n = 4, cp = b0 & 0x07;
  else return 0;
  if (pos + n > text.size()) return 0;
  for (size_t i = 1; i < n; ++i) {
    const auto b = static_cast<unsigned char>(text[pos + i]);
    if ((b & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (b & 0x3F);
  }
  static constexpr uint32_t kMinForLength[5] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < kMinForLength[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  return n;
}

// What each thread matches with: a JIT stack larger than PCRE2's 32 KiB default (long runs of one class).
struct ThreadMatchState {
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* jit_stack = nullptr;
  ThreadMatchState() {
    context = pcre2_match_context_create(nullptr);
    jit_stack = pcre2_jit_stack_create(64 * 1024, 8 * 1024 * 1024, nullptr);
    LOOM_CHECK(context && jit_stack, "PCRE2: out of memory for a match context");
    pcre2_jit_stack_assign(context, nullptr, jit_stack);
  }
  ~ThreadMatchState() {
    pcre2_jit_stack_free(jit_stack);
    pcre2_match_context_free(context);
  }
};

}  // namespace

struct Pretokenizer::Compiled {
  pcre2_code* code = nullptr;
  ~Compiled() { pcre2_code_free(code); }
};

Pretokenizer::Pretokenizer(const std::string& pattern) : pattern_(pattern), compiled_(std::make_unique<Compiled>()) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  compiled_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                  PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr);
  LOOM_REQUIRE(compiled_->code, "pre-tokenizer pattern /", pattern, "/: ", pcre2_message(error), " at offset ",
               offset);
  pcre2_jit_compile(compiled_->code, PCRE2_JIT_COMPLETE);  // where JIT is unsupported, the interpreter matches
}

Pretokenizer::~Pretokenizer() = default;
Pretokenizer::Pretokenizer(Pretokenizer&&) noexcept = default;
Pretokenizer& Pretokenizer::operator=(Pretokenizer&&) noexcept = default;

std::vector<std::string_view> Pretokenizer::split(std::string_view text) const {
  // Invalid UTF-8 bytes become U+FFFD (a symbol: no letter, number or space) in a copy that the pattern runs over;
  // `original` maps the copy's offsets back to the text's.
  std::string copy;
  std::vector<size_t> original;
  std::string_view subject = text;
  for (size_t p = 0; p < text.size();) {
    const size_t len = utf8_length(text, p);
    if (len == 0 && original.empty()) {  // the first invalid byte: copy what came before
      copy.assign(text.substr(0, p));
      original.resize(p + 1);
      for (size_t i = 0; i <= p; ++i) original[i] = i;
    }
    if (!original.empty()) {
      if (len == 0) copy += "\xEF\xBF\xBD";
      else copy.append(text.substr(p, len));
      original.resize(copy.size() + 1, p + std::max<size_t>(len, 1));
    }
    p += std::max<size_t>(len, 1);
  }
  if (!original.empty()) subject = copy;
  auto to_text = [&](size_t offset) { return original.empty() ? offset : original[offset]; };

  thread_local ThreadMatchState state;
  pcre2_match_data* match = pcre2_match_data_create_from_pattern(compiled_->code, nullptr);
  LOOM_CHECK(match, "PCRE2: out of memory for match data");
  std::vector<std::string_view> pieces;
  const auto* s = reinterpret_cast<PCRE2_SPTR>(subject.data());
  size_t pos = 0;
  auto add = [&](size_t begin, size_t end) {
    pieces.push_back(text.substr(to_text(begin), to_text(end) - to_text(begin)));
  };
  // PCRE2's match limit bounds one match, not the text: a pattern that backtracks catastrophically ((a+)+b) would
  // spend its whole limit at every position. So each match starts with a small limit, doubled while it is hit, and
  // every limit hit is charged to a budget for the whole text; a text that exhausts it is an error naming the limit.
  const uint64_t budget_total = kMatchStepsPerByte * uint64_t(subject.size()) + kMatchStepsBase;
  uint64_t budget = budget_total;
  while (pos < subject.size()) {
    int rc = 0;
    for (uint32_t limit = 1024;; limit *= 2) {
      pcre2_set_match_limit(state.context, limit);
      rc = pcre2_match(compiled_->code, s, subject.size(), pos, PCRE2_NO_UTF_CHECK | PCRE2_NOTEMPTY, match,
                       state.context);
      if (rc != PCRE2_ERROR_MATCHLIMIT) break;
      if (limit > budget || limit >= (1u << 30)) {
        pcre2_match_data_free(match);
        LOOM_THROW("pre-tokenizer pattern /", pattern_, "/: matching a text of ", text.size(),
                   " bytes exhausted its work budget (", budget_total, " backtracking steps: ", kMatchStepsPerByte,
                   " per byte plus ", kMatchStepsBase, ") at byte ", to_text(pos),
                   "; a pattern with nested repetition such as (a+)+ backtracks without end on some texts");
      }
      budget -= limit;
    }
    if (rc == PCRE2_ERROR_NOMATCH) {
      add(pos, subject.size());
      break;
    }
    if (rc < 0) {
      pcre2_match_data_free(match);
      LOOM_THROW("pre-tokenizer pattern /", pattern_, "/ failed at byte ", to_text(pos), ": ", pcre2_message(rc));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(match);
    if (ov[0] > pos) add(pos, ov[0]);  // text the pattern skipped
    add(ov[0], ov[1]);
    pos = ov[1];
  }
  pcre2_match_data_free(match);
  return pieces;
}

}  // namespace loom::data
