"""``ngramrl bench-steps``: the drafting proposer's time per engine step at B requests in flight.

Each trace's last epoch is replayed as one rollout phase through ``ngramrl.bench.steps`` (its
earlier epochs are the history), with copies of its prompts where it has fewer than 2B rollouts,
so that B requests stay in flight for most steps. The step time reported is the proposer's call,
the critical path of a synchronous engine step; it is measured on the steps with B requests in
flight. The forward's length, which is how long a prefetch worker may run and what the proposer's
step-cost model learns, comes from a step profile (default: the roofline of a Qwen3-8B shape on
an H100). With ``repeats`` the grid of runs for a trace and batch size is run several times,
every other time in reverse order (A B B A), and each run's step time is also read against the
first run of its own repeat: a ratio of two runs minutes apart on a busy host moves with the
host, a ratio of neighbours much less. JSON: docs/bench-contract.md.
"""

from __future__ import annotations

import json
import os
import statistics
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

from ngramrl.bench.machine import machine_facts, machine_line
from ngramrl.bench.report import print_now
from ngramrl.bench.run import load_traces
from ngramrl.bench.steps import (
    POOL_METHOD,
    POOL_START_MISSING,
    PoolBench,
    build_engine,
    copies_for,
    method_available,
    prepare_workload,
    summarize_steps,
)
from ngramrl.config import EngineConfig, HistoryConfig, NgramRLConfig, PrefetchConfig
from ngramrl.core.profile import MODEL_SHAPES, StepProfile, load_profile, roofline_profile
from ngramrl.core.trace import Trace
from ngramrl.paths import OutputPaths

BENCH_STEPS_VERSION = 1
STEP_METHODS = ("ngramrl", "ngramrl-prefetch", "suffix")  # the default
THREADED = ("ngramrl", "ngramrl-prefetch", POOL_METHOD)  # the methods whose drafting core runs on --threads


@dataclass
class BenchStepsConfig:
    traces: list[str]
    batches: list[int]
    threads: list[int] = field(default_factory=lambda: [1])
    methods: list[str] = field(default_factory=lambda: list(STEP_METHODS))
    k: int = 8
    profile: str | None = None    # a step profile's path; None: the H100 roofline of Qwen3-8B
    flush_mb: float = 32.0
    draft_always: bool = False    # every row drafts k tokens every step: the step-cost model off
    budgets: list[int] = field(default_factory=lambda: [PrefetchConfig().budget])  # ngramrl-prefetch: one run each
    max_budgets: list[int] = field(default_factory=lambda: [PrefetchConfig().max_budget])  # ... with each of these
    windows_move: bool = False    # every prompt's window moves on in the replayed epoch (an RL run's steady state)
    repeats: int = 1              # the grid of runs per trace and batch, this many times, in alternating order
    pool: PoolBench = field(default_factory=PoolBench)  # ngramrl-pool's drafter pool
    json_out: str | None = None

    def __post_init__(self) -> None:
        if not self.traces:
            raise ValueError("no trace given")
        if not self.batches or any(b < 1 for b in self.batches):
            raise ValueError(f"--batch values must be >= 1, got {self.batches}")
        if not self.threads or any(t < 1 for t in self.threads):
            raise ValueError(f"--threads values must be >= 1, got {self.threads}")
        for method in self.methods:
            if method not in (*STEP_METHODS, POOL_METHOD):
                raise ValueError(f"unknown method {method!r}; choose from {', '.join((*STEP_METHODS, POOL_METHOD))}")
        if self.k < 1:
            raise ValueError(f"--k must be >= 1, got {self.k}")
        if self.flush_mb < 0:
            raise ValueError(f"--flush-mb must be >= 0, got {self.flush_mb}")
        if not self.budgets or any(b < 1 for b in self.budgets):
            raise ValueError(f"--budget values must be >= 1, got {self.budgets}")
        if not self.max_budgets or any(b < 0 for b in self.max_budgets):
            raise ValueError(f"--max-budget values must be >= 0, got {self.max_budgets}")
        if self.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {self.repeats}")


def prefetch_coverage(proposer: object) -> float | None:
    """The fraction of the phase's lookups whose draft was ready from the prefetch (None for a
    proposer without these counters: SuffixDecoding)."""
    stats = getattr(proposer, "stats", None)
    if stats is None or not hasattr(stats, "lookup_rows"):
        return None
    return round(stats.prefetch_hits / stats.lookup_rows, 4) if stats.lookup_rows else 0.0


def resumed_misses(proposer: object) -> float | None:
    """Of the phase's lookups that missed the prefetch, the fraction that resumed from the match
    states the prefetch's outcome model had walked (None where the core does not count them: the
    reference core, SuffixDecoding)."""
    stats, core = getattr(proposer, "stats", None), getattr(proposer, "core", None)
    timings = core.timings() if hasattr(core, "timings") else {}
    if stats is None or "resumed_lookups" not in timings:
        return None
    misses = stats.lookup_rows - stats.prefetch_hits
    return round(timings["resumed_lookups"] / misses, 4) if misses else 0.0


def step_runs(config: BenchStepsConfig) -> list[tuple[str, int, tuple[int, int] | None]]:
    """(method, threads, (prefetch budget, max budget)) of each run for one trace and batch size:
    every thread count for the ngramrl methods (SuffixDecoding's core is single-threaded: one
    run), every budget with every max budget for ngramrl-prefetch and the pool (its engine
    prefetches as ngramrl-prefetch does; None: a method without prefetch)."""
    def budgets_of(method: str) -> list[tuple[int, int] | None]:
        if method in ("ngramrl-prefetch", POOL_METHOD):
            return [(b, m) for b in config.budgets for m in config.max_budgets]
        return [None]

    return [(method, threads, budgets) for method in config.methods
            for threads in (config.threads if method in THREADED else config.threads[:1])
            for budgets in budgets_of(method)]


def repeat_order(grid: list, repeat: int) -> list:
    """The grid's runs in the order of one repeat: forward, then backward (A B B A), so that a host
    getting slower or faster during the benchmark weighs on every run alike."""
    return list(grid) if repeat % 2 == 0 else list(reversed(grid))


RunKey = tuple[str, int, int | None, int | None]  # (method, threads, budget, max budget)


def run_key(run: dict) -> RunKey:
    return run["method"], run["threads"], run["budget"], run["max_budget"]


def _median(runs: Iterable[dict], field: str) -> float:
    return round(statistics.median(run[field] for run in runs), 3)


def summarize_repeats(runs: list[dict], first: RunKey) -> list[dict]:
    """Per configuration of one trace and batch size, over its repeats: the median of the runs'
    mean step time with its range, of their median step and time per request, and the median of
    its mean step time over that of ``first``'s run in the same repeat (a paired ratio)."""
    by_key: dict[RunKey, dict[int, dict]] = {}
    for run in runs:
        by_key.setdefault(run_key(run), {})[run["repeat"]] = run
    baseline = by_key[first]
    summary = []
    for key, repeats in by_key.items():
        means = [run["step_us_mean"] for run in repeats.values()]
        ratios = [run["step_us_mean"] / baseline[r]["step_us_mean"] for r, run in repeats.items()
                  if r in baseline and baseline[r]["step_us_mean"] > 0]
        some = next(iter(repeats.values()))
        summary.append({"trace": some["trace"], "method": key[0], "batch": some["batch"], "threads": key[1],
                        "budget": key[2], "max_budget": key[3], "repeats": len(repeats),
                        "step_us_mean": _median(repeats.values(), "step_us_mean"), "step_us_mean_min": min(means),
                        "step_us_mean_max": max(means),
                        "step_us_median": _median(repeats.values(), "step_us_median"),
                        "request_us_mean": _median(repeats.values(), "request_us_mean"),
                        "paired_with": {"method": first[0], "threads": first[1], "budget": first[2],
                                        "max_budget": first[3]},
                        "step_mean_ratio": round(statistics.median(ratios), 4) if ratios else None})
    return summary


def run_label(run: dict, repeat: str = "") -> str:
    """How bench-steps names a run (or a configuration's summary) at the start of its line."""
    return (f"{os.path.basename(run['trace']):<28} {run['method']:<17} B={run['batch']:<5} T={run['threads']:<3} "
            + repeat
            + ("" if run["budget"] is None else f"budget {run['budget']:<3} max {run['max_budget']:<3} "))


def repeats_line(entry: dict) -> str:
    """One configuration's summary over its repeats, as bench-steps prints it."""
    paired = entry["paired_with"]
    ratio = entry["step_mean_ratio"]
    return (run_label(entry)
            + f"over {entry['repeats']} repeats: step mean {entry['step_us_mean']:.1f} us (median; "
            f"{entry['step_us_mean_min']:.1f}-{entry['step_us_mean_max']:.1f}), "
            f"median {entry['step_us_median']:.1f} us, {entry['request_us_mean']:.1f} us/request"
            + ("" if ratio is None else f", {ratio:.3f}x {paired['method']} T={paired['threads']}'s mean step "
                                        "(paired by repeat, median)"))


def budget_mean(proposer: object) -> float | None:
    """The mean budget per request the proposer's prefetches ran with (PrefetchConfig.max_budget
    lets it grow), or None for a proposer that did not prefetch in the background."""
    stats = getattr(getattr(proposer, "source", None), "stats", None)
    mean = stats().get("prefetch_budget_mean") if stats is not None else None
    return None if mean is None else round(mean, 2)


def replay_history(trace: Trace, windows_move: bool) -> HistoryConfig:
    """The drafter's window for replaying the trace's last epoch. With ``windows_move`` it keeps
    the epochs before the replayed one only (counted from the trace's first: a trace cut from a
    long run may start at any epoch): each prompt's first finished rollout evicts its oldest
    epoch's, as in an RL run once every prompt has more epochs than the window keeps (its index
    is rebuilt, once per epoch). Without it the window holds every epoch and every rollout of
    the trace (at least the default's), however far apart its epoch numbers are: no window moves."""
    epochs = [r.epoch for r in trace.rollouts]
    span = max(epochs) - min(epochs)
    if windows_move:
        return HistoryConfig(epochs_kept=max(1, span))
    default = HistoryConfig()
    per_prompt = Counter(r.prompt_id for r in trace.rollouts)
    stored = sum(default.prompt_tail + 1 + len(r.output) for r in trace.rollouts)
    return HistoryConfig(epochs_kept=max(default.epochs_kept, span + 1),
                         rollouts_per_prompt=max(default.rollouts_per_prompt, max(per_prompt.values())),
                         max_tokens=max(default.max_tokens, 2 * stored))


def default_profile(k: int) -> StepProfile:
    return roofline_profile("h100", MODEL_SHAPES["qwen3-8b"], k=k)


def run_bench_steps(config: BenchStepsConfig, log: Callable[[str], None] = print_now) -> dict:
    inputs = [*config.traces, *([config.profile] if config.profile else [])]
    config.json_out = OutputPaths(inputs=inputs).file(config.json_out, "--json")
    traces = load_traces(config.traces)  # every one read and checked for epochs to replay before any work starts
    for trace in traces:
        last = max(r.epoch for r in trace.rollouts)
        if not any(r.output for r in trace.rollouts if r.epoch == last):
            raise ValueError(f"{trace.path}: nothing to replay: bench-steps replays the last epoch ({last}), and "
                             f"every one of its rollouts has an empty output")
    profile = load_profile(config.profile) if config.profile else default_profile(config.k)
    skipped = {m: why for m in config.methods if (why := method_available(m))}
    for method, why in skipped.items():
        log(f"bench-steps: skipping {method}: {why}")
    if POOL_METHOD in config.methods and POOL_METHOD not in skipped and config.pool.start is None:
        raise ValueError(POOL_START_MISSING)
    engine_config = EngineConfig(adaptive_length=not config.draft_always)
    runs: list[dict] = []
    result = {"ngramrl_bench_steps": BENCH_STEPS_VERSION, "runs": runs,
              "profile": {"source": profile.source, "model": profile.model.get("name"),
                          "device": profile.device.get("name"), "path": config.profile},
              "k": config.k, "flush_mb": config.flush_mb, "draft_always": config.draft_always,
              "windows_move": config.windows_move, "repeats": config.repeats, "machine": machine_facts()}
    log(machine_line(result["machine"]))
    if config.repeats > 1:
        result["summary"] = []
    if POOL_METHOD in config.methods:
        result["pool"] = {"shards": config.pool.shards, "sync_wait_ms": config.pool.sync_wait_ms}

    def write(partial: bool) -> None:
        # after every run: a benchmark that is stopped leaves what it finished
        if config.json_out:
            with open(config.json_out, "w") as handle:
                json.dump({**result, "partial": True} if partial else result, handle, indent=1)

    for trace in traces:
        last = max(r.epoch for r in trace.rollouts)
        history = replay_history(trace, config.windows_move)
        grid = [entry for entry in step_runs(config) if entry[0] not in skipped]
        for batch in config.batches:
            workload = prepare_workload(trace, last, copies_for(trace, last, 2 * batch))
            batch_runs: list[dict] = []
            for repeat, (method, threads, budgets) in ((r, entry) for r in range(config.repeats)
                                                       for entry in repeat_order(grid, r)):
                budget, max_budget = budgets or (None, None)
                prefetch = (PrefetchConfig(budget=budget, max_budget=max_budget) if budgets is not None
                            else PrefetchConfig())
                engine = build_engine(method, workload, config.k, profile, threads, int(config.flush_mb * (1 << 20)),
                                      config=NgramRLConfig(history=history, engine=engine_config, prefetch=prefetch),
                                      pool=config.pool)
                try:
                    records = engine.run_phase(workload.phases[0], batch)
                finally:
                    engine.close()
                summary = summarize_steps(records, batch)
                run = {"trace": trace.path, "method": method, "batch": batch,
                       "threads": threads if method in THREADED else 1, "budget": budget,
                       "max_budget": max_budget, "repeat": repeat,
                       **{key: round(value, 3) if isinstance(value, float) else value
                          for key, value in asdict(summary).items()},
                       "prefetch_coverage": prefetch_coverage(engine.proposer),
                       "resumed_misses": resumed_misses(engine.proposer),
                       "budget_mean": budget_mean(engine.proposer)}
                if method == POOL_METHOD:  # how the engine's copies of the pool's windows kept up
                    pool_stats = engine.proposer.source.stats()
                    run.update(sync_calls=pool_stats["pool_calls"], late_syncs=pool_stats["pool_late_syncs"],
                               unsynced_prompts=pool_stats["pool_down_prompts"],
                               sync_us_median=pool_stats["pool_sync_us_median"],
                               batch_sync_ms=round(sum(engine.batch_ns) / 1e6, 3))
                runs.append(run)
                batch_runs.append(run)
                write(partial=True)
                log(run_label(run, "" if config.repeats == 1 else f"repeat {repeat:<2} ")
                    + f"steps {run['steps']:>5}  "
                    f"step {run['step_us_median']:>9.1f} / {run['step_us_mean']:>9.1f} / {run['step_us_p99']:>9.1f} us "
                    f"(median/mean/p99)  {run['request_us_mean']:>6.1f} us/request  offpath "
                    f"{run['offpath_us_mean']:>8.1f} us  tok/fwd {run['tokens_per_forward']:.3f}"
                    + ("" if run["prefetch_coverage"] is None else f"  prefetched {run['prefetch_coverage']:.3f}")
                    + ("" if run["resumed_misses"] is None else f"  misses resumed {run['resumed_misses']:.3f}")
                    + ("" if run["budget_mean"] is None else f"  budget mean {run['budget_mean']:.1f}"))
            if config.repeats > 1 and batch_runs:
                repeated = summarize_repeats(batch_runs, run_key(batch_runs[0]))  # the grid's first run
                result["summary"].extend(repeated)
                write(partial=True)
                for entry in repeated:
                    log(repeats_line(entry))
    write(partial=False)
    if config.json_out:
        log(f"wrote {config.json_out}")
    return result
