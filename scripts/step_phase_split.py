"""Where the proposer's time goes at B requests in flight: one bench-steps replay (`--draft-always`
unless --cost-model, k = 8, the H100 Qwen3-8B roofline forward, a 32 MB pass per step by default)
with the proposer's call, the native core's calls and the proposer's own array and request
bookkeeping timed from Python, and the core's own step split into its phases (`core.timings()`:
waiting for the background, the inserts of pending tokens, the commits with the prefetch's hits,
the lookups), averaged over the steps with B requests in flight; also Python's cycle collections
inside the proposer's call, the steps whose work the proposer kept in its call
(``OffloadChoice``'s tries), and the budgets of the prefetches that full steps stopped, with
their work's share of the window (docs/native.md, "Where a step's time goes").

    python scripts/step_phase_split.py ngramrl/traces/gsm-smollm2-t0.6.jsonl.gz 256 --threads 2

Run it from a checkout (the checkout's ngramrl is imported); it needs the native core.
"""

from __future__ import annotations

import argparse
import collections
import gc
import sys
import time

sys.path.insert(0, ".")

from ngramrl.bench.bench_steps import default_profile  # noqa: E402
from ngramrl.bench.steps import build_engine, copies_for, prepare_workload, summarize_steps  # noqa: E402
from ngramrl.config import EngineConfig, HistoryConfig, NgramRLConfig, PrefetchConfig  # noqa: E402
from ngramrl.core.rows import DraftBatch  # noqa: E402
from ngramrl.core.trace import read_trace  # noqa: E402
from ngramrl.engine import vllm_proposer  # noqa: E402

PHASES = ("step_wait_ns", "step_absorb_ns", "step_commit_ns", "step_lookup_ns", "step_lookups")
CALLS = ("stop", "start_many", "step", "lengths", "prefetch", "finish_many")
GLUE = ("committed_rows", "for_target")  # vLLM's rows to the core's arrays, and the drafts to vLLM's lists
# The batch's request ids to ranks with the admissions, the admissions alone, the requests that left
REQUESTS = ("_states", "_admit", "_retire")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("batch", type=int)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--method", default="ngramrl-prefetch", choices=("ngramrl", "ngramrl-prefetch"))
    parser.add_argument("--budget", type=int, default=PrefetchConfig().budget, help="prefetch lookups per request")
    parser.add_argument("--max-budget", type=int, default=PrefetchConfig().max_budget,
                        help="how far the budget may grow where the forward leaves the prefetch time (at most "
                             "--budget: fixed)")
    parser.add_argument("--flush-mb", type=float, default=32.0,
                        help="size of the cache-polluting pass standing in for the forward (MB; 0: none)")
    parser.add_argument("--per-request", action="store_true",
                        help="each request's budget its own (share_budget off), not shared across the batch")
    parser.add_argument("--cost-model", action="store_true",
                        help="the step-cost model on (bench-steps without --draft-always): it may keep drafting off "
                             "but for probes; the steps with lookups and those without are also shown apart")
    parser.add_argument("--epochs-kept", type=int, default=HistoryConfig().epochs_kept,
                        help="HistoryConfig.epochs_kept: 3 with the shipped traces' epochs 0-2 as history moves every "
                             "prompt's window on during the replay (bench-steps --windows-move); fewer also makes the "
                             "cross-prompt index stale")
    args = parser.parse_args()
    if args.flush_mb < 0:
        raise SystemExit(f"--flush-mb must be >= 0, got {args.flush_mb}")
    trace = read_trace(args.trace)
    last = max(r.epoch for r in trace.rollouts)
    workload = prepare_workload(trace, last, copies_for(trace, last, 2 * args.batch))
    history = HistoryConfig(epochs_kept=args.epochs_kept)
    config = NgramRLConfig(history=history, engine=EngineConfig(adaptive_length=args.cost_model),
                           prefetch=PrefetchConfig(budget=args.budget, max_budget=args.max_budget,
                                                   share_budget=not args.per_request))
    engine = build_engine(args.method, workload, 8, default_profile(8), args.threads, int(args.flush_mb * (1 << 20)),
                          config=config)
    proposer, core = engine.proposer, engine.proposer.core
    if not core.native:
        raise SystemExit("the native core is not built (pip install -e . builds it)")

    step_totals: collections.Counter = collections.Counter()  # this call's times, ns
    full: dict[str, list[float]] = collections.defaultdict(list)
    last_timings: dict[str, int] = dict(core.timings())

    def timed(name: str, call):
        def run(*a, **k):
            begin = time.perf_counter_ns()
            out = call(*a, **k)
            step_totals[name] += time.perf_counter_ns() - begin
            if name == "step":  # nothing runs in the background during a step: timings() does not wait
                now = core.timings()
                for phase in PHASES:
                    step_totals[phase] += now[phase] - last_timings[phase]
                last_timings.update(now)
            return out
        return run

    for name in CALLS:
        setattr(core, name, timed(name, getattr(core, name)))
    vllm_proposer.committed_rows = timed("committed_rows", vllm_proposer.committed_rows)
    DraftBatch.for_target = timed("for_target", DraftBatch.for_target)
    for name in REQUESTS:
        setattr(proposer, name, timed(name, getattr(proposer, name)))
    propose = proposer.propose
    collector = {"ns": 0, "runs": 0, "started": 0}  # Python's cycle collections, while in the proposer's call
    in_call = [False]

    def on_collection(phase: str, info: dict) -> None:
        if not in_call[0]:
            return
        now = time.perf_counter_ns()
        if phase == "start":
            collector["started"] = now
        else:
            collector["ns"] += now - collector["started"]
            collector["runs"] += 1

    gc.callbacks.append(on_collection)
    # Steps whose work the proposer kept in its call (OffloadChoice's tries) and the steps after them.
    kept_in_call: list[tuple[int, int, bool]] = []  # (critical path ns, lookups, kept in the call)

    def timed_propose(sampled, *a, **k):
        step_totals.clear()
        collected, runs, inline = collector["ns"], collector["runs"], proposer.stats.inline_steps
        in_call[0] = True
        in_full_step[0] = len(sampled) == args.batch
        begin = time.perf_counter_ns()
        out = propose(sampled, *a, **k)
        elapsed = time.perf_counter_ns() - begin
        in_call[0] = False
        if len(sampled) == args.batch:
            full["propose"].append(elapsed)
            for key in (*CALLS, *GLUE, *REQUESTS, *PHASES):
                full[key].append(step_totals[key])
            full["collector_ns"].append(collector["ns"] - collected)
            full["collections"].append(collector["runs"] - runs)
            kept_in_call.append((elapsed, step_totals["step_lookups"], proposer.stats.inline_steps > inline))
        return out

    # The prefetches a full step's stop ended (take_span): the budget they ran with and how much
    # of their window their work took.
    spans: list = []
    take_span = core.take_span

    def full_step_span():
        span = take_span()
        if span is not None and in_full_step[0] and span.chosen > 0:
            spans.append(span)
        return span

    in_full_step = [False]
    core.take_span = full_step_span
    proposer.propose = timed_propose
    try:
        summary = summarize_steps(engine.run_phase(workload.phases[0], args.batch), args.batch)
    finally:
        engine.close()
    steps = len(full["propose"])
    print(f"{args.trace} B={args.batch} {args.method} threads {args.threads}: {steps} full steps, "
          f"critical path mean {summary.step_us_mean:.0f} us")
    mean = {key: sum(values) / max(1, len(values)) for key, values in full.items()}
    inside = sum(mean[name] for name in CALLS)
    print(f"  proposer call        {mean['propose'] / 1e3:8.0f} us (the longest {max(full['propose']) / 1e3:.0f} us)")
    for name in CALLS:
        print(f"    core.{name:<14} {mean[name] / 1e3:8.0f} us")
    print(f"    Python around them {(mean['propose'] - inside) / 1e3:8.0f} us")
    print(f"      of which the rows to arrays (committed_rows) {mean['committed_rows'] / 1e3:.0f} us, "
          f"the drafts to vLLM's lists (for_target) {mean['for_target'] / 1e3:.0f} us")
    print(f"      the batch's ranks (_states less _admit) {(mean['_states'] - mean['_admit']) / 1e3:.1f} us, "
          f"admissions (_admit, core.start_many in it) {mean['_admit'] / 1e3:.1f} us, "
          f"the requests that left (_retire) {mean['_retire'] / 1e3:.1f} us")
    print(f"    Python's cycle collector inside the call {mean['collector_ns'] / 1e3:.1f} us "
          f"({mean['collections']:.2f} collections per step)")
    tried = [i for i, (_, _, inline) in enumerate(kept_in_call) if inline]
    after = [i + 1 for i in tried if i + 1 < len(kept_in_call)]
    if tried:
        print(f"    steps that kept their work in the call (OffloadChoice's tries) {tried}: "
              f"{', '.join(f'{kept_in_call[i][0] / 1e6:.1f}' for i in tried)} ms; the steps after them "
              f"{', '.join(f'{kept_in_call[i][0] / 1e6:.1f} ms ({kept_in_call[i][1]} lookups)' for i in after)}")
    if args.cost_model:
        for label, looked in (("with lookups", True), ("without", False)):
            kinds = [i for i in range(steps) if (full["step_lookups"][i] > 0) == looked]
            if kinds:
                calls = sorted(full["propose"][i] for i in kinds)
                print(f"    the steps {label}: {len(kinds)}, proposer call median "
                      f"{calls[len(calls) // 2] / 1e3:.0f} us, mean {sum(calls) / len(calls) / 1e3:.0f} us, "
                      f"core.step mean "
                      f"{sum(full['step'][i] for i in kinds) / len(kinds) / 1e3:.0f} us, lookups "
                      f"{sum(full['step_lookups'][i] for i in kinds) / len(kinds):.0f} per step")
    print("  the native step's phases:")
    for phase in PHASES[:-1]:
        print(f"    {phase[5:-3]:<18} {mean[phase] / 1e3:8.0f} us")
    print(f"    lookups per step   {mean['step_lookups']:8.1f}")
    counters = core.counters()
    print(f"  over the replay: {counters['rebuilds']} prompt index builds, {counters['global_builds']} cross-prompt")
    timings = core.timings()
    if timings["plan_rows"]:  # the background's work, over the whole phase
        print(f"  the prefetch: planning {timings['plan_ns'] / timings['plan_rows'] / 1e3:.1f} us per row, "
              f"{timings['prefetch_lookup_ns'] / max(1, timings['prefetch_lookups']) / 1e3:.1f} us per lookup")
    if spans:
        budgets = collections.Counter(span.chosen // args.batch for span in spans)
        finished = [span.work_s / span.window_s for span in spans if span.done == span.chosen]
        shares = sorted(finished) or [0.0]
        print(f"  the prefetches full steps stopped: {len(spans)}, by budget per request "
              f"{dict(sorted(budgets.items()))}; {len(finished)} finished all they chose, their work taking "
              f"{shares[len(shares) // 10]:.2f}-{shares[len(shares) * 9 // 10]:.2f} of the window "
              f"(10th-90th percentile)")
    source = proposer.source.stats()
    if "prefetch_budget_mean" in source:
        print(f"  the budget per request: {source['prefetch_budget_mean']:.1f} on average, {source['prefetch_budget']} "
              "at the end")


if __name__ == "__main__":
    main()
