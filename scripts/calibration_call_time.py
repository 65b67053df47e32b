"""Time the native core's calibration calls (lengths, chances, observe) at one engine step's size.

    python scripts/calibration_call_time.py [--rows 256] [--k 16]

Prints the median over 7 rounds of 300 calls of each, in microseconds per call. Run it in two
checkouts (each with its extension built) one after the other, twice, to compare two versions.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from ngramrl.config import DrafterConfig, HistoryConfig, PrefetchConfig
from ngramrl.core.batch import make_core


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--k", type=int, default=16)
    args = parser.parse_args()
    core = make_core(HistoryConfig(), DrafterConfig(), PrefetchConfig(), native=True)
    rng = np.random.default_rng(0)
    probs = rng.random(args.rows * args.k)
    offsets = np.arange(0, args.rows * args.k + 1, args.k)
    accepted = np.full(args.rows, 3)
    fit = (0.03, 0.001, 0.001, 0.0, 0)
    calls = {"lengths": lambda: core.lengths(probs, offsets, 1.0, fit, 0.0),
             "chances": lambda: core.chances(probs, offsets),
             "observe": lambda: core.observe(probs, offsets, accepted)}
    for name, call in calls.items():
        rounds = []
        for _ in range(7):
            begin = time.perf_counter()
            for _ in range(300):
                call()
            rounds.append((time.perf_counter() - begin) / 300 * 1e6)
        print(f"{name}: {sorted(rounds)[3]:.1f} us per call ({args.rows} rows x {args.k} estimates)")


if __name__ == "__main__":
    main()
