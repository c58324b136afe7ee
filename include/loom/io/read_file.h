// Reading a whole input file, the one way every reader of configs, tokenizers, prompts, checkpoint metadata and traces
// does it: the path must be a regular file (a directory, /dev/zero or a pipe is refused before a byte is read, so an
// endless file cannot exhaust memory), no larger than the reader's bound, and it is noted as an input of the run
// (input_guard.h), so no output of the run can replace it.
#pragma once

#include <cstdint>
#include <string>

namespace loom::io {

// Bounds for the kinds of file Loom reads whole (far above any real one, far below what would exhaust memory).
inline constexpr uint64_t kMaxSmallFileBytes = uint64_t(1) << 20;     // a 'latest' file, a policy, a prompt's flags
inline constexpr uint64_t kMaxConfigFileBytes = uint64_t(64) << 20;   // run and model configs, checkpoint metadata
inline constexpr uint64_t kMaxTokenizerFileBytes = uint64_t(1) << 30; // tokenizer.json, encoder.json, tokenizer.model
inline constexpr uint64_t kMaxDataFileBytes = uint64_t(1) << 40;      // text to tokenize, op traces, prompts

// How a file read is used: an input, which no output of the run may replace; or a file the run itself updates (a
// cache, a checkpoint directory's 'latest'), which is not noted as an input.
enum class FileUse { kInput, kUpdated };

// The file's bytes. Errors are one line: "<what> '<path>': does not exist" / "is a directory, not a file" / "is 3 GB,
// more than the 1 GB such a file may be" / "cannot be read: <reason>".
std::string read_input_file(const std::string& path, uint64_t max_bytes, const std::string& what,
                            FileUse use = FileUse::kInput);

// "1.5 GB", "312 KB", "17 bytes": a byte count for messages.
std::string byte_size_text(double bytes);

}  // namespace loom::io
