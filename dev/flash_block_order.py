#!/usr/bin/env python3
"""How long a causal flash attention launch runs past its mean work, per order of its blocks.

A model of the GPU's block scheduler: the blocks of a launch are taken in index order into `slots` free slots
(SMs x blocks an SM), each slot running one block at a time at a speed of one tile of work a unit of time. Block
b of a head (b = 0 the longest) has work(b) tiles. Prints the finish time over the mean (total work / slots) for
three orders: head by head; every head's block 0, then every head's block 1 (longest first across all heads);
and that order within sections of heads (kernels/cuda/flash_tile.cuh's flash_grid), which keeps a section's K and
V in L2. The model leaves out that a block alone on an SM runs faster than beside another, so it overstates the
tails of kernels that run two blocks an SM.

    python3 dev/flash_block_order.py            # OLMo-1B (micro-batch 4) and GPT-2 (16) on an H100's 132 SMs
"""
import argparse
import heapq


def finish(works, slots):
    free = [0.0] * slots
    for w in works:
        heapq.heappush(free, heapq.heappop(free) + w)
    return max(free)


def orders(heads, per_head, work, section):
    by_head = [work(b) for _ in range(heads) for b in range(per_head)]
    longest_first = [work(b) for b in range(per_head) for _ in range(heads)]
    sectioned = [work(b) for _ in range(heads // section) for b in range(per_head) for _ in range(section)]
    return {"head by head": by_head, "longest first": longest_first, f"sections of {section}": sectioned}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sms", type=int, default=132)
    args = p.parse_args()
    # (name, heads, blocks a head, work of block b in tiles, blocks an SM, heads a section)
    launches = [
        ("OLMo-1B forward (128 queries, key tiles of 64)", 64, 16, lambda b: 2 * (16 - b), 2, 32),
        ("OLMo-1B dK/dV (128 keys, query tiles of 64)", 64, 16, lambda b: 32 - 2 * b, 1, 32),
        ("OLMo-1B dQ (128 queries, key tiles of 32)", 64, 16, lambda b: 4 * (16 - b), 2, 32),
        ("GPT-2 forward", 192, 8, lambda b: 2 * (8 - b), 2, 96),
        ("GPT-2 dK/dV", 192, 8, lambda b: 16 - 2 * b, 1, 96),
        ("GPT-2 dQ (key tiles of 64)", 192, 8, lambda b: 2 * (8 - b), 2, 96),
    ]
    for name, heads, per_head, work, per_sm, section in launches:
        slots = args.sms * per_sm
        rows = orders(heads, per_head, work, section)
        mean = sum(rows["head by head"]) / slots
        print(f"{name}, {slots} slots: " + ", ".join(f"{k} {finish(v, slots) / mean:.3f}x" for k, v in rows.items()))


if __name__ == "__main__":
    main()
