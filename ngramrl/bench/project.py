"""``ngramrl project``: a rollout phase's time on a GPU, projected from a trace and a step profile.

Each epoch of a trace after the first is one rollout phase (the first is history, as in
``ngramrl bench``): its requests are submitted at once, at most B run at a time, a finished
request's slot goes to the next (continuous batching). Every engine step costs the profile's
time for its shape (requests, tokens verified, context, prefill), plus the host's work per step:
run between forwards by a synchronous scheduler (vLLM's, with any n-gram-style drafter), hidden
behind the forward by an asynchronous one (no speculation). Drafting methods also pay their
proposer's call, measured for real on this machine's CPU as ``ngramrl bench-steps`` measures it;
work a prefetch worker did during the forward is hidden. ngramrl's drafts and draft lengths are
chosen by its own proposer, whose step-cost model learns the simulated step times online, as in
an engine: it is not told the profile.

This is a projection: the forward is the profile's, not a run of the model, and the drafts are
verified against the recorded rollouts. JSON: docs/bench-contract.md.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field

from ngramrl.bench.machine import machine_facts, machine_line
from ngramrl.bench.report import print_now
from ngramrl.bench.run import load_traces
from ngramrl.bench.steps import ENGINE_METHODS, build_engine, copies_for, method_available, prepare_workload
from ngramrl.core.profile import HostOverhead, StepProfile, load_profile
from ngramrl.core.trace import Trace
from ngramrl.paths import OutputPaths

PROJECT_VERSION = 1
BANNER = "PROJECTION, not a measurement"


@dataclass
class ProjectConfig:
    traces: list[str]
    profile: str
    batches: list[int]
    methods: list[str] = field(default_factory=lambda: list(ENGINE_METHODS))
    k: int = 8
    threads: int = 1
    copies: int | None = None       # copies of the trace's prompts per phase; None: enough for B requests
    waves: bool = False             # each wave of B requests drains before the next (a generate-call loop)
    host: HostOverhead | None = None  # overrides the profile's host overhead
    flush_mb: float = 32.0
    cpu_scale: float = 1.0          # the proposers' CPU time counts this many times what it takes here
    jobs: int = 1                   # (trace, batch) units projected at once, each in a process of its own
    json_out: str | None = None

    def __post_init__(self) -> None:
        if not self.traces:
            raise ValueError("no trace given")
        if self.cpu_scale < 0:
            raise ValueError(f"--cpu-scale must be >= 0, got {self.cpu_scale}")
        if not self.batches or any(b < 1 for b in self.batches):
            raise ValueError(f"--engine-batch values must be >= 1, got {self.batches}")
        for method in self.methods:
            if method not in ENGINE_METHODS:
                raise ValueError(f"unknown method {method!r}; choose from {', '.join(ENGINE_METHODS)}")
        if self.k < 1:
            raise ValueError(f"--k must be >= 1, got {self.k}")
        if self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        if self.copies is not None and self.copies < 1:
            raise ValueError(f"--copies must be >= 1, got {self.copies}")
        if self.flush_mb < 0:
            raise ValueError(f"--flush-mb must be >= 0, got {self.flush_mb}")
        if self.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {self.jobs}")


def profile_summary(profile: StepProfile, path: str, cpu_scale: float) -> dict:
    return {"path": path, "source": profile.source, "model": profile.model.get("name"),
            "device": profile.device.get("name"), "k": profile.k, "host": profile.host.__dict__,
            "floor_ms": profile.floor_ms, "cpu_scale": cpu_scale}


def run_project(config: ProjectConfig, log: Callable[[str], None] = print_now) -> dict:
    config.json_out = OutputPaths(inputs=[*config.traces, config.profile]).file(config.json_out, "--json")
    profile = load_profile(config.profile)
    traces = load_traces(config.traces)  # every one read and checked for epochs to replay before any work starts
    if config.host is not None:
        profile.host = config.host
    if config.k > profile.k:
        log(f"project: the profile was made for drafts of up to {profile.k} tokens; steps verifying more are "
            f"extrapolated")
    methods = ["none", *[m for m in config.methods if m != "none"]]  # the reference always runs
    skipped = {m: why for m in methods if (why := method_available(m))}
    for method, why in skipped.items():
        log(f"project: skipping {method}: {why}")
    log(f"{BANNER}: {profile.source} step profile of {profile.model.get('name')} on {profile.device.get('name')}; "
        f"host work {profile.host.base_ms:g} ms + {profile.host.per_request_ms * 1000:g} us per request per step"
        + (f"; drafting CPU time x {config.cpu_scale:g}" if config.cpu_scale != 1.0 else ""))
    runs, fastest = [], float("inf")
    summary = profile_summary(profile, config.profile, config.cpu_scale)
    machine = machine_facts()  # where the drafting's CPU time was measured
    log(machine_line(machine))

    def write(partial: bool) -> None:
        # after every run: a projection that is stopped leaves what it finished
        if config.json_out:
            summary["fastest_step_ms"] = round(fastest, 4) if math.isfinite(fastest) else None
            result = {"ngramrl_project": PROJECT_VERSION, "note": BANNER, "profile": summary, "machine": machine,
                      "runs": runs}
            if partial:
                result["partial"] = True
            with open(config.json_out, "w") as handle:
                json.dump(result, handle, indent=1)

    units = [(trace, batch) for trace in traces for batch in config.batches]
    done: dict[int, list[dict]] = {}
    for index, (unit_runs, unit_fastest) in _project_units(units, methods, skipped, profile, config):
        fastest = min(fastest, unit_fastest)
        for run in unit_runs:
            log(f"{os.path.basename(run['trace']):<28} B={run['engine_batch']:<5} {run['method']:<17} "
                f"{run['rollout_seconds']:>9.3f} s  {run['speedup_vs_none'] or 0:>6.3f}x none  "
                f"tok/fwd {run['tokens_per_forward']:>6.3f}  steps {run['steps']:>6}  "
                f"drafting {run['draft_ms_per_step']:>7.3f} ms/step  ({run.pop('seconds_here'):.0f} s here)")
        done[index] = unit_runs
        runs[:] = [run for i in sorted(done) for run in done[i]]  # in the order asked, whatever finished first
        write(partial=True)
    summary["fastest_step_ms"] = round(fastest, 4) if math.isfinite(fastest) else None
    if profile.floor_ms is not None and fastest < profile.floor_ms:
        log(f"project: WARNING: a step took {fastest:.3f} ms, less than reading the weights once at the device's "
            f"bandwidth ({profile.floor_ms:.3f} ms): the profile is not physical")
    write(partial=False)
    if config.json_out:
        log(f"wrote {config.json_out}")
    return {"ngramrl_project": PROJECT_VERSION, "note": BANNER, "profile": summary, "runs": runs}


def _project_units(units: list, methods: list[str], skipped: dict, profile: StepProfile,
                   config: ProjectConfig) -> Iterator[tuple[int, tuple[list[dict], float]]]:
    """Each (trace, batch) unit's index and result as it finishes. With ``jobs`` > 1 the units run
    in processes of their own (spawned: the parent's drafting threads are not forked), the longest
    (the smallest batches) first, so each method's drafting time is measured on a core of its own
    where the machine has one per job."""
    if config.jobs == 1 or len(units) == 1:
        for index, (trace, batch) in enumerate(units):
            yield index, project_unit(trace, batch, methods, skipped, profile, config)
        return
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(config.jobs, len(units)), mp_context=context) as pool:
        order = sorted(range(len(units)), key=lambda i: units[i][1])
        futures = {pool.submit(project_unit, *units[i], methods, skipped, profile, config): i for i in order}
        for future in as_completed(futures):
            yield futures[future], future.result()


def project_unit(trace: Trace, batch: int, methods: list[str], skipped: dict, profile: StepProfile,
                 config: ProjectConfig) -> tuple[list[dict], float]:
    """One trace's rollout phases at engine batch ``batch``, every method, no speculation first:
    the runs and the fastest decode step's milliseconds."""
    # the phases are the epochs the replay benchmark counts (1 and later); copies fill the first
    first = min(r.epoch for r in trace.rollouts if r.epoch >= 1 and r.output)
    copies = config.copies or copies_for(trace, first, batch)
    workload = prepare_workload(trace, 1, copies)
    reference, fastest, runs = None, float("inf"), []
    for method in methods:
        if method in skipped:
            continue
        began = time.perf_counter()
        # The forwards are not waited out in real time (an epoch's phases would take their
        # simulated time here), so the prefetch's budget grows only into the replay's own time.
        engine = build_engine(method, workload, config.k, profile, config.threads,
                              int(config.flush_mb * (1 << 20)), cpu_scale=config.cpu_scale, wait_out=False)
        records = []
        try:
            for phase in workload.phases:
                records.extend(engine.run_phase(phase, batch, config.waves))
        finally:
            engine.close()
        seconds = sum(r.seconds(engine.synchronous) for r in records)
        # (a trace whose outputs are one token long decodes nothing: every step is a prefill)
        fastest = min(fastest, min((r.forward_s for r in records if r.decode_rows), default=math.inf) * 1000.0)
        if method == "none":
            reference = seconds
        runs.append({"trace": trace.path, "method": method, "engine_batch": batch,
                     "rollout_seconds": round(seconds, 6),
                     "speedup_vs_none": round(reference / seconds, 4) if reference else None,
                     "tokens_per_forward": round(sum(r.committed for r in records)
                                                 / max(1, sum(r.rows for r in records)), 4),
                     "steps": len(records),
                     "draft_ms_per_step": round(statistics.fmean(r.critical_ns for r in records) / 1e6, 4),
                     "copies": copies, "requests": sum(len(p) for p in workload.phases),
                     "seconds_here": time.perf_counter() - began})
    return runs, fastest
