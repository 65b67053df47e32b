"""One bench-steps replay (ngramrl-prefetch, --draft-always, k = 8, 2 threads, the H100 Qwen3-8B
roofline forward, a 32 MB pass per step) that also prints the native core's own step time and
how many of the lookups that missed the prefetch resumed from the outcome model's walked match
states (docs/native.md, "Misses resume from the walked match states").

    python scripts/miss_resume_replay.py ngramrl/traces/gsm-smollm2-t0.6.jsonl.gz 1024

Run it from a checkout (the checkout's ngramrl is imported). To compare two builds, run it from
each in A B B A order, so that a host whose speed drifts weighs both alike.
"""

from __future__ import annotations

import argparse
import sys

sys.path.insert(0, ".")

from ngramrl.bench.bench_steps import default_profile  # noqa: E402
from ngramrl.bench.steps import build_engine, copies_for, prepare_workload, summarize_steps  # noqa: E402
from ngramrl.config import EngineConfig, NgramRLConfig  # noqa: E402
from ngramrl.core.trace import read_trace  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("batch", type=int)
    args = parser.parse_args()
    trace = read_trace(args.trace)
    last = max(r.epoch for r in trace.rollouts)
    workload = prepare_workload(trace, last, copies_for(trace, last, 2 * args.batch))
    config = NgramRLConfig(engine=EngineConfig(adaptive_length=False))
    engine = build_engine("ngramrl-prefetch", workload, 8, default_profile(8), 2, 32 << 20, config=config)
    try:
        summary = summarize_steps(engine.run_phase(workload.phases[0], args.batch), args.batch)
        stats, timings = engine.proposer.stats, engine.proposer.core.timings()
    finally:
        engine.close()
    misses = stats.lookup_rows - stats.prefetch_hits
    resumed = timings.get("resumed_lookups")  # absent in a build without the resume
    print(f"critical path per full step: mean {summary.step_us_mean:.0f} us, median {summary.step_us_median:.0f} us; "
          f"native step per step: {timings['step_ns'] / max(1, stats.steps) / 1e3:.0f} us over {stats.steps} steps")
    print(f"lookups {stats.lookup_rows}, prefetched {stats.prefetch_hits}, missed {misses}, "
          f"resumed {resumed} ({(resumed or 0) / max(1, misses):.3f} of the misses)")


if __name__ == "__main__":
    main()
