"""Run the replay benchmark over traces, methods and draft lengths."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ngramrl.bench.methods import METHOD_NAMES, NgramRLMethod, NgramRLTreeMethod, make_method
from ngramrl.bench.replay import ReplayResult, replay
from ngramrl.bench.siblings import SIBLING_METHODS, make_sibling_method, replay_siblings
from ngramrl.bench.steps import method_available
from ngramrl.config import DrafterConfig, HistoryConfig, PrefetchConfig
from ngramrl.core.trace import Trace, read_trace

SWEEP_BUDGETS = [1, 2, 4, 8, 16, 32, 64]
REGIMES = ("epochs", "siblings")  # earlier epochs of the same prompts / only the siblings in flight
EPOCH_METHODS = ("ngramrl", "suffix", "pld")  # what --by-epoch follows
MAX_K = 256  # replay time grows with k (every step walks k tokens); engines verify far fewer


def builtin_traces() -> list[str]:
    """The traces shipped with the package (SmolLM2-135M-Instruct rollouts; see docs/benchmark.md)."""
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "traces")
    return sorted(os.path.join(folder, name) for name in os.listdir(folder) if name.endswith((".jsonl", ".jsonl.gz")))


@dataclass
class BenchConfig:
    traces: list[str]
    methods: list[str] = field(default_factory=lambda: list(METHOD_NAMES))
    ks: list[int] = field(default_factory=lambda: [16])
    budget: int = 16
    sweep: list[int] = field(default_factory=list)  # extra budgets whose coverage is also measured
    tree_width: int = 4  # root-to-leaf paths of ngramrl-tree's drafts
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    history: HistoryConfig = field(default_factory=HistoryConfig)
    regime: str = "epochs"
    by_epoch: bool = False  # also tokens per forward epoch by epoch (the epochs regime)

    def __post_init__(self) -> None:
        if not self.traces:
            raise ValueError("no trace given")
        if self.regime not in REGIMES:
            raise ValueError(f"--regime must be one of {', '.join(REGIMES)}, got {self.regime!r}")
        allowed = SIBLING_METHODS if self.regime == "siblings" else METHOD_NAMES
        for name in self.methods:
            if name not in METHOD_NAMES:
                raise ValueError(f"unknown method {name!r}; choose from {', '.join(allowed)}")
            if name not in allowed:
                raise ValueError(f"method {name!r} is not in the {self.regime} regime; choose from "
                                 f"{', '.join(allowed)}")
        for name in self.methods:
            missing = method_available(name)
            if missing:
                raise ValueError(f"method {name!r} cannot run here: {missing}")
        if self.sweep and "ngramrl" not in self.methods:
            raise ValueError("--sweep and --coverage-plot measure the ngramrl method's prefetch coverage; "
                             "add --method ngramrl")
        if self.by_epoch and self.regime != "epochs":
            raise ValueError("--by-epoch splits the epochs regime's replay; the siblings regime has no earlier epochs")
        if self.regime == "siblings" and self.sweep:
            raise ValueError("the prefetch coverage sweep runs in the epochs regime only")
        for k in self.ks:
            if not 1 <= k <= MAX_K:
                raise ValueError(f"--k must be between 1 and {MAX_K} (the most draft tokens per step), got {k}")
        if self.budget < 1:
            raise ValueError(f"--budget must be >= 1, got {self.budget}")
        if self.tree_width < 1:
            raise ValueError(f"--tree-width must be >= 1, got {self.tree_width}")


def drafter_for(trace: Trace, base: DrafterConfig) -> DrafterConfig:
    """The trace's end-of-sequence tokens end drafts: nothing after them is generated."""
    stops = tuple(sorted(set(base.stop_tokens) | set(trace.header.eos_token_ids)))
    return DrafterConfig(**{**base.__dict__, "stop_tokens": stops})


def measure_history_memory(trace: Trace, config: HistoryConfig, reference: bool | None = None) -> dict:
    """Bytes the drafter's state takes per stored token, with every rollout of the trace indexed
    (per-prompt and cross-prompt indexes): the native core's under ``native`` where it is built;
    the Python reference's, measured with tracemalloc, where it is not (it is then what drafts) or
    where ``reference`` asks for it (tracemalloc over a long trace takes minutes, and the
    reference's objects gigabytes)."""
    native = measure_native_memory(trace, config)
    report: dict = {}
    if reference or (reference is None and native is None):
        report = _reference_memory(trace, config)
    if native is not None:
        report["native"] = native
    return report


def _reference_memory(trace: Trace, config: HistoryConfig) -> dict:
    import tracemalloc

    from ngramrl.core.history import RolloutHistory

    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    history = RolloutHistory(config)
    for rollout in trace.rollouts:
        history.add_rollout(rollout.prompt_id, rollout.prompt, rollout.output, rollout.epoch)
    for prompt_id in history.prompt_ids():
        history.index_of(prompt_id)
    history.global_index()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    tokens = history.stored_tokens
    return {"stored_tokens": tokens, "bytes": used, "bytes_per_token": round(used / max(1, tokens), 1)}


def _malloc_in_use() -> int | None:
    """Bytes glibc's malloc has handed out and not taken back (mallinfo2), or None elsewhere."""
    import ctypes
    import ctypes.util

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                         "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallinfo2.restype = MallInfo2
    except (OSError, AttributeError, TypeError):
        return None
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def measure_native_memory(trace: Trace, config: HistoryConfig) -> dict | None:
    """The same history in the native core (tracemalloc cannot see C++ memory): the bytes its
    structures hold by their own count, and what malloc handed out meanwhile, per stored token.
    None when the extension is not built."""
    from ngramrl.core.batch import make_core
    from ngramrl.core.extension import native_module

    if native_module() is None:
        return None
    before = _malloc_in_use()
    core = make_core(config, native=True)
    for rollout in trace.rollouts:
        core.add_rollout(rollout.prompt_id, rollout.prompt, rollout.output, rollout.epoch)
    core.build_indexes()
    after = _malloc_in_use()
    tokens = core.stored_tokens
    counted = core.memory_bytes()
    report = {"stored_tokens": tokens, "bytes": counted, "bytes_per_token": round(counted / max(1, tokens), 1)}
    if before is not None and after is not None:
        report["malloc_bytes_per_token"] = round((after - before) / max(1, tokens), 1)
    core.close()
    return report


def load_traces(paths: list[str], regime: str = "epochs") -> list[Trace]:
    """Read and validate every trace before any work starts; each must have something to replay."""
    traces = [read_trace(path) for path in paths]
    for trace in traces:
        if regime == "siblings":
            if not any(r.output for r in trace.rollouts):
                raise ValueError(f"{trace.path}: nothing to replay: no rollout has output tokens")
            continue
        if not any(r.epoch >= 1 for r in trace.rollouts):
            epochs = trace.epochs()
            held = f"epoch {epochs[0]} only" if epochs else "no rollouts"
            raise ValueError(f"{trace.path}: nothing to replay: it holds {held}; the replay counts rollouts of "
                             f"epoch 1 and later, drafted from the epochs before them (trace-format.md)")
        if not any(r.output for r in trace.rollouts if r.epoch >= 1):
            raise ValueError(f"{trace.path}: nothing to replay: every rollout of epoch 1 and later has an empty "
                             f"output")
    return traces


def run_bench(config: BenchConfig, progress: bool = True) -> list[ReplayResult]:
    from tqdm import tqdm

    traces = load_traces(config.traces, config.regime)
    if config.regime == "siblings":
        return _run_siblings(config, traces)
    replayed = sum(sum(1 for r in t.rollouts if r.epoch >= 1) for t in traces)
    total = replayed * len(config.methods) * len(config.ks)
    bar = tqdm(total=total, desc="replay", unit="rollout", disable=not progress, leave=False)
    results: list[ReplayResult] = []
    for trace in traces:
        for k in config.ks:
            for name in config.methods:
                bar.set_postfix_str(f"{trace.workload} k={k} {name}")
                method = make_method(name, drafter_for(trace, config.drafter), config.history,
                                     PrefetchConfig(budget=config.budget), [config.budget], config.tree_width)
                result = replay(trace, method, k, trace.path, on_rollout=lambda: bar.update(1))
                if isinstance(method, NgramRLTreeMethod):
                    result.tree_width = method.width
                elif isinstance(method, NgramRLMethod):
                    result.coverage = method.coverage_report(config.budget)
                    if config.sweep and k == config.ks[0]:
                        # A separate replay: looking up the top 64 would inflate the main run's timings.
                        swept = NgramRLMethod(config.history, drafter_for(trace, config.drafter),
                                              PrefetchConfig(budget=max(config.sweep)), config.sweep)
                        replay(trace, swept, k, trace.path)
                        result.coverage["sweep"] = {str(b): round(swept.tally.value(b), 4) for b in config.sweep}
                results.append(result)
    bar.close()
    return results


def _run_siblings(config: BenchConfig, traces: list[Trace]) -> list[ReplayResult]:
    """The fresh-prompts regime (``ngramrl.bench.siblings``): every prompt-epoch on its own."""
    results = []
    for trace in traces:
        for k in config.ks:
            for name in config.methods:
                method = make_sibling_method(name, drafter_for(trace, config.drafter), config.history)
                results.append(replay_siblings(trace, method, k, trace.path))
    return results


def run_by_epoch(config: BenchConfig) -> dict[str, dict[int, list]]:
    """Tokens per forward epoch by epoch for each trace and k (``ngramrl.bench.epochs``), for the
    methods of ``EPOCH_METHODS`` the config has."""
    from ngramrl.bench.epochs import replay_by_epoch

    out: dict[str, dict[int, list]] = {}
    for trace in load_traces(config.traces):
        for k in config.ks:
            out.setdefault(trace.path, {})[k] = [
                replay_by_epoch(trace, name, k, drafter_for(trace, config.drafter), config.history)
                for name in config.methods if name in EPOCH_METHODS]
    return out
