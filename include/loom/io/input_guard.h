// No output of a run replaces a file the run read. Readers of weights, checkpoints, configs and token files note
// their inputs; every write through AtomicFileWriter (safetensors, llm.c files, token shards, JSON files) and every
// directory a writer clears is checked against them. The apps turn this on at their start (protect_inputs); a
// library user who rewrites files it loaded is not stopped.
#pragma once

#include <string>

namespace loom::io {

// Turns the checks on (or off) for this process (every app calls it first thing).
void protect_inputs(bool on = true);
// Records that this run read `path` (a file or a directory). Does nothing unless protect_inputs() was called.
void note_input(const std::string& path);
// Throws one line when writing `path` would replace an input (the same path, a hard link or a symlink to it) or
// when `path` exists and is not a regular file (a directory, a device such as /dev/null, a pipe): the second check
// holds even without protect_inputs(), since an atomic write would replace the device node itself.
void check_output_file(const std::string& path);
// "a directory", "a character device", ...: what a path that is not a regular file is, for messages.
std::string file_kind(unsigned mode);
// Throws one line when an input lies in `dir` (or is it), for a writer that replaces or removes files there.
void check_output_dir(const std::string& dir);

}  // namespace loom::io
