"""Replay recorded rollouts through drafting methods (``docs/bench-contract.md``).

Warm-cache regime: rollouts of epoch 0 only build history; each rollout of epoch e >= 1 is
replayed with what was known before epoch e started. One step proposes a draft of at most k
tokens, accepts its longest prefix equal to the recorded tokens, and commits that prefix plus
one token from the target (fewer at the end of the output): one target forward. A method may
propose a draft tree of at most k nodes instead; the step then accepts its longest root path that
the recorded tokens follow.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import groupby

from ngramrl.bench.methods import ReplayMethod
from ngramrl.core.trace import Rollout, Trace
from ngramrl.core.tree import DraftTree


@dataclass
class ReplayResult:
    trace: str
    workload: str
    method: str
    k: int
    rollouts: int = 0
    tokens: int = 0
    forwards: int = 0
    accepted_hist: list[int] = field(default_factory=list)  # accepted draft tokens -> steps
    drafted: int = 0  # draft tokens sent to verification (a chain's first k, a tree's nodes)
    accepted: int = 0  # of them, accepted
    step_ns: list[int] = field(default_factory=list)      # per step: the critical path (propose, commit)
    cpu_ns: list[int] = field(default_factory=list)       # per step: all the method's work (and its background)
    coverage: dict | None = None
    tree_width: int | None = None  # root-to-leaf paths of a tree method's drafts
    regime: str = "epochs"  # what the method drafted from (ngramrl.bench.run.REGIMES)

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / self.forwards if self.forwards else 0.0

    @property
    def drafted_per_forward(self) -> float:
        """Draft tokens a forward verified, on average: tokens per forward says what they brought,
        this what they cost (a GPU verifies them nearly free at small batches, not at large ones)."""
        return self.drafted / self.forwards if self.forwards else 0.0

    @property
    def acceptance(self) -> float | None:
        """Accepted over drafted tokens."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def draft_us_per_step(self) -> float | None:
        """The contract's: median CPU microseconds spent proposing one draft, off the critical path too."""
        return statistics.median(self.cpu_ns) / 1000 if self.cpu_ns else None

    @property
    def critical_us_per_step(self) -> float | None:
        """Median microseconds of a step's drafting on the engine's critical path (a prefetched
        draft costs only its commit; the prefetch overlaps the target's forward)."""
        return statistics.median(self.step_ns) / 1000 if self.step_ns else None

    def to_json(self) -> dict:
        return {
            "trace": self.trace,
            "workload": self.workload,
            "method": self.method,
            "regime": self.regime,
            "k": self.k,
            "rollouts": self.rollouts,
            "tokens": self.tokens,
            "forwards": self.forwards,
            "tokens_per_forward": round(self.tokens_per_forward, 4),
            "drafted_per_forward": round(self.drafted_per_forward, 4),
            "acceptance": None if self.acceptance is None else round(self.acceptance, 4),
            "coverage": self.coverage,
            "draft_us_per_step": None if self.draft_us_per_step is None else round(self.draft_us_per_step, 3),
            "critical_us_per_step": None if self.critical_us_per_step is None else round(self.critical_us_per_step, 3),
            **({} if self.tree_width is None else {"tree_width": self.tree_width}),
        }


def accepted_prefix(draft: list[int], truth: list[int]) -> int:
    n = 0
    for a, b in zip(draft, truth, strict=False):
        if a != b:
            break
        n += 1
    return n


def accepted_length(draft: list[int] | DraftTree, truth: list[int], k: int) -> int:
    """Draft tokens a step accepts: the longest prefix of a chain (at most k tokens) equal to the
    recorded tokens, or the longest root path of a tree (at most k nodes) that they follow. For
    drafts without probabilities that is what exact verification accepts when the target samples
    the recorded tokens."""
    if isinstance(draft, DraftTree):
        if len(draft) > k:
            raise ValueError(f"a draft tree of {len(draft)} nodes exceeds k = {k}")
        return len(draft.accept(truth))
    return accepted_prefix(draft[:k], truth)


def replay(
    trace: Trace,
    method: ReplayMethod,
    k: int,
    trace_name: str | None = None,
    on_rollout: Callable[[], None] | None = None,
    on_step: Callable[[list[int] | DraftTree, int, Rollout, int], None] | None = None,
) -> ReplayResult:
    """Replay ``trace`` through ``method``. ``on_step(draft, accepted, rollout, position)`` sees every step."""
    result = ReplayResult(trace_name or trace.path, trace.workload, method.name, k)
    result.accepted_hist = [0] * (k + 1)
    clock = time.perf_counter_ns
    for epoch, group in groupby(trace.rollouts, key=lambda r: r.epoch):
        rollouts = list(group)
        if epoch >= 1:
            for rollout in rollouts:
                method.start(rollout)
                output = rollout.output
                position = 0
                carried = 0  # the first token's commit: in the proposer's first call, with its first draft
                if output:
                    # The prefill's forward samples the first token and verifies no draft: an
                    # engine drafts from a sampled token on (vLLM calls its proposer after it).
                    begin = clock()
                    method.commit(output[:1])
                    carried = clock() - begin
                    if on_step is not None:
                        on_step([], 0, rollout, 0)
                    position = 1
                    result.forwards += 1
                    result.accepted_hist[0] += 1
                while position < len(output):
                    begin = clock() - carried
                    carried = 0
                    draft = method.propose(k)
                    proposed = clock()
                    measuring = getattr(method, "measuring_ns", 0)
                    method.background()  # overlaps the target's forward: off the critical path
                    result.step_ns.append(proposed - begin)
                    result.cpu_ns.append(clock() - begin - (getattr(method, "measuring_ns", 0) - measuring))
                    accepted = accepted_length(draft, output[position:], k)
                    result.drafted += len(draft) if isinstance(draft, DraftTree) else min(len(draft), k)
                    result.accepted += accepted
                    committed = output[position:position + accepted + 1]
                    if on_step is not None:
                        on_step(draft, accepted, rollout, position)
                    begin = clock()
                    method.commit(committed)
                    committing = clock() - begin
                    result.step_ns[-1] += committing
                    result.cpu_ns[-1] += committing
                    position += len(committed)
                    result.forwards += 1
                    result.accepted_hist[min(accepted, len(committed) - 1)] += 1
                result.tokens += len(output)
                result.rollouts += 1
                method.finish()
                if on_rollout is not None:
                    on_rollout()
        method.add_history(rollouts)
    return result
