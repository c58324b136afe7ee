// Byte-level BPE by merge rank, the one implementation GPT-2's tokenizer and a tokenizer.json share: the lowest-ranked
// adjacent pair merges first, the leftmost among equals (what GPT-2's encoder.py and Hugging Face's BPE do), in
// O(n log n) for a piece of n bytes (a scan per merge was quadratic: a 1 MB word took hours).
#pragma once

#include <cstdint>
#include <queue>
#include <string_view>
#include <vector>

namespace loom::data::detail {

inline uint64_t bpe_pair_key(int32_t left, int32_t right) { return uint64_t(uint32_t(left)) << 32 | uint32_t(right); }

// Appends the ids of `piece` to `out`: each byte's id (byte_ids), then merges by rank. `merges` maps
// bpe_pair_key(left id, right id) to a value with `rank` and `merged` (the id of the pair's token).
template <typename Merges>
void bpe_by_rank(std::string_view piece, const int32_t (&byte_ids)[256], const Merges& merges,
                 std::vector<int32_t>& out) {
  // Parts as a linked list by start offset (next[s]: where the part at s ends; id[s]: its token); a heap of candidate
  // merges by (rank, start). A candidate is stale once either part has merged elsewhere: the part at `start` then no
  // longer ends at `mid`, or the one at `mid` no longer at `end`.
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
    if (auto it = merges.find(bpe_pair_key(id[start], id[mid])); it != merges.end())
      heap.push({it->second.rank, start, mid, next[mid]});
  };
  for (uint32_t i = 0; i < n; ++i) {
    next[i] = i + 1;
    prev[i] = i - 1;  // wraps for i = 0: never read
    id[i] = byte_ids[static_cast<unsigned char>(piece[i])];
  }
  for (uint32_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    if (!alive[c.start] || next[c.start] != c.mid || !alive[c.mid] || next[c.mid] != c.end) continue;
    id[c.start] = merges.at(bpe_pair_key(id[c.start], id[c.mid])).merged;
    alive[c.mid] = false;
    next[c.start] = c.end;
    if (c.end < n) prev[c.end] = c.start;
    if (c.start > 0) push(prev[c.start]);
    push(c.start);
  }
  for (uint32_t s = 0; s < n; s = next[s]) out.push_back(id[s]);
}

}  // namespace loom::data::detail
