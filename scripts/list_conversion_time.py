"""The proposer's two conversions at vLLM's boundary, C++ against the Python path, each timed alone
after a 32 MB pass (as after a forward), alternating, medians of 10: the drafts to one list per row
(``DraftBatch.lists``, random drafts of 0-8 tokens; ``DraftBatch.for_target``, the same drafts
truncated to random lengths with the lists made from them) and the sampled tokens to flat arrays
(``committed_rows``, rows of 1-9 tokens in a shuffled arrival order, half of them sent a draft).

    python scripts/list_conversion_time.py
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, ".")

from ngramrl.core.rows import DraftBatch, committed_rows  # noqa: E402


def timed(call, flush: np.ndarray) -> dict[str, float]:
    runs: dict[str, list[float]] = {"1": [], "0": []}
    for mode in ("1", "0") * 10:
        os.environ["NGRAMRL_NATIVE"] = mode  # "0": the Python path
        flush.sum()
        begin = time.perf_counter_ns()
        call()
        runs[mode].append((time.perf_counter_ns() - begin) / 1e3)
    os.environ.pop("NGRAMRL_NATIVE")
    return {mode: statistics.median(values) for mode, values in runs.items()}


def main() -> None:
    rng = np.random.default_rng(0)
    flush = np.ones(8 << 20, dtype=np.float32)
    for n in (256, 1024):
        sizes = rng.integers(0, 9, n)
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(sizes, out=offsets[1:])
        tokens = rng.integers(0, 150_000, int(offsets[-1])).astype(np.int32)
        batch = DraftBatch(tokens, offsets, np.zeros(len(tokens)), np.zeros(n, np.int32), np.zeros(n, np.int8),
                           np.zeros(n, bool))
        rows = np.flatnonzero(sizes)
        lists = timed(lambda: batch.lists(n, rows, rows), flush)  # noqa: B023
        keep = rng.integers(0, 9, n)
        target = timed(lambda: batch.for_target(keep, 150_000, n, np.arange(n)), flush)  # noqa: B023
        sampled = [[random.randrange(150_000) for _ in range(random.randrange(1, 10))] for _ in range(n)]
        arrival = rng.permutation(n).astype(np.int64)
        num_tokens = rng.integers(100, 200, n)
        sent_ranks = np.sort(rng.choice(n, n // 2, replace=False)).astype(np.int64)
        sent_offsets = np.concatenate([[0], np.cumsum(rng.integers(0, 9, len(sent_ranks)))]).astype(np.int64)
        flat = timed(lambda: committed_rows(sampled, arrival, num_tokens, 4096, 8, sent_ranks,  # noqa: B023
                                            sent_offsets), flush)  # noqa: B023
        print(f"B={n}: DraftBatch.lists C++ {lists['1']:.0f} us, Python {lists['0']:.0f} us; "
              f"DraftBatch.for_target C++ {target['1']:.0f} us, Python {target['0']:.0f} us; "
              f"committed_rows C++ {flat['1']:.0f} us, Python {flat['0']:.0f} us")


if __name__ == "__main__":
    main()
