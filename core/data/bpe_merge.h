// Byte-pair merging of one word, shared by the GPT-2 and tiktoken vocabularies (bpe.cpp); a template so that
// the rank lookup and the output inline into each tokenizer's loop.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string_view>
#include <vector>

namespace trainer {

// Byte-pair merging of one word in O(n log n). Parts start as single bytes; pair_rank(a, mid, b) ranks
// joining [a, mid) and [mid, b) (negative: they never join). The candidate pairs wait in a min-heap
// keyed (rank, start): the lowest rank merges first, the leftmost on ties. A merge links the part to its
// new right neighbour and adds the two pairs it creates; an entry whose pair has since changed (a part
// merged elsewhere: the right part's end moved) is dropped when it comes up.
// With `rounds` (gpt-3-encoder), a rank merges as one round: the rightmost current pair of that rank
// names the bigram (its split: two pairs can share a key "a,b"), every current occurrence of that bigram
// merges left to right, and the pairs the round creates, or leaves of the other split, join the heap
// after it, as its rescan would see them. emit(a, b) gets the final parts, left to right.
template <class Rank, class Emit>
void merge_word(std::string_view word, Rank pair_rank, bool rounds, Emit emit) {
    const size_t n = word.size();
    std::vector<size_t> end(n), prev(n);  // part starting at byte i: [i, end[i]), dead when end[i] == 0
    for (size_t i = 0; i < n; ++i) end[i] = i + 1, prev[i] = i == 0 ? SIZE_MAX : i - 1;
    struct Candidate {
        int64_t rank;
        size_t left;       // start of the left part
        size_t right_end;  // end of the right part when added: the pair is current while it still is
        bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
    };
    std::vector<Candidate> heap, held, round;
    auto push = [&](const Candidate& c) {
        heap.push_back(c);
        std::push_heap(heap.begin(), heap.end(), std::greater<>());
    };
    auto pop = [&] {
        std::pop_heap(heap.begin(), heap.end(), std::greater<>());
        const Candidate c = heap.back();
        heap.pop_back();
        return c;
    };
    auto add = [&](size_t left) {  // the pair starting at `left`, if it has a rank
        const size_t right = end[left];
        if (right >= n) return;
        const int64_t r = pair_rank(left, right, end[right]);
        if (r < 0) return;
        if (rounds)
            held.push_back({r, left, end[right]});
        else
            push({r, left, end[right]});
    };
    auto current = [&](const Candidate& c) {
        const size_t right = end[c.left];
        return right != 0 && right < n && end[right] == c.right_end;
    };
    auto merge = [&](const Candidate& c) {
        const size_t right = end[c.left];
        end[c.left] = c.right_end;
        end[right] = 0;
        if (c.right_end < n) prev[c.right_end] = c.left;
        if (prev[c.left] != SIZE_MAX) add(prev[c.left]);
        add(c.left);
    };
    for (size_t i = 0; i + 1 < n; ++i) {
        const int64_t r = pair_rank(i, i + 1, i + 2);
        if (r >= 0) heap.push_back({r, i, i + 2});
    }
    std::make_heap(heap.begin(), heap.end(), std::greater<>());
    while (!heap.empty()) {
        if (!rounds) {
            const Candidate c = pop();
            if (current(c)) merge(c);
            continue;
        }
        round.clear();
        const int64_t r = heap.front().rank;
        while (!heap.empty() && heap.front().rank == r) {
            const Candidate c = pop();
            if (current(c)) round.push_back(c);  // in order of position
        }
        if (round.empty()) continue;
        const size_t split = end[round.back().left] - round.back().left;  // the bigram's first symbol's length
        for (const Candidate& c : round) {
            if (!current(c)) continue;  // overlapped by the merge before it
            if (end[c.left] - c.left == split)
                merge(c);
            else
                held.push_back(c);
        }
        for (const Candidate& c : held) push(c);
        held.clear();
    }
    for (size_t i = 0; i < n; i = end[i]) emit(i, end[i]);
}

}  // namespace trainer
