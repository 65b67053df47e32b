"""Where the vLLM proposer's drafts come from.

``NgramRLProposer`` (``ngramrl.engine.vllm_proposer``) decides, per engine step, which rows look
up and how much of each draft to verify (its step-cost model); a ``DraftSource`` makes the drafts
and keeps what drafting knows (the rollout history, the acceptance calibration). Two sources:

- ``CoreSource``: the drafting core (``ngramrl.core.batch``) in the engine process;
- ``PoolSource`` (``ngramrl.pipeline.pool_proposer``): the Ray drafter pool's client, the history
  in CPU actors beside the engines.

Every call takes or returns a whole step's rows as arrays (``StepRows``, ``DraftBatch``).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ngramrl.config import DrafterConfig, NgramRLConfig
from ngramrl.core.batch import make_core
from ngramrl.core.outcome import next_budget
from ngramrl.core.rows import DraftBatch


@dataclass
class StepRows:
    """This step's rows with a prompt id and committed tokens, as arrays: row i is the batch's row
    ``index[i]``, request ``req_ids[i]`` with drafting state ``requests[i]``; it committed
    ``tokens[offsets[i]:offsets[i + 1]]`` and has room for a draft of ``ks[i]`` tokens (0: no lookup);
    ``drafting`` rows have room (each NumPy call after a forward costs microseconds: counted once)."""

    index: np.ndarray    # int64
    batch: tuple[str, ...]  # the engine's request ids, by batch row
    requests: Any        # the source's states: the core's handles (int64 array), or a list
    tokens: np.ndarray   # int32
    offsets: np.ndarray  # int64, rows + 1
    ks: np.ndarray       # int32
    drafting: int        # rows with ks > 0

    @property
    def req_ids(self) -> list[str]:
        """Each row's request id, made when asked: only the drafter pool's client reads them (a
        list over a thousand rows is tens of microseconds after a forward)."""
        return [self.batch[i] for i in self.index.tolist()]

    def __len__(self) -> int:
        return len(self.index)

    def sampled(self, i: int) -> list[int]:
        return self.tokens[self.offsets[i]:self.offsets[i + 1]].tolist()

    def prefetched(self, looked_up: bool) -> np.ndarray | None:
        """The rows whose next draft is prefetched after this step (None: every row): those that
        looked up, each from the part of its draft sent for verification (maybe none of it); the
        others (k = 0) sent no draft and keep their tokens as they are. After a step without
        lookups, every row, each from its empty draft (its next token is the one outcome)."""
        if not looked_up or self.drafting == len(self):
            return None
        return self.ks > 0


class DraftSource(Protocol):
    """What the proposer asks of where its drafts come from."""

    core: Any  # the drafting core in this process, or None
    offloads: bool  # whether end_step can run its work in the background or in the call (``offload``)

    def start_many(self, req_ids: list[str], prompt_ids: list[str], prompts: list[list[int]],
                   befores: list[list[int]]) -> list[Any]:
        """Requests with a prompt id start, in the order given (``befores``: their tokens so far);
        returns their states. The lists are the engine's: read, not kept."""

    def finish_many(self, requests: list[Any], epochs: list[int]) -> None:
        """The requests left the engine, in the order given: their outputs become rollouts of their epochs."""

    def begin_step(self) -> None:
        """The forward that verified the last drafts is over."""

    def draft(self, rows: StepRows) -> DraftBatch:
        """Commit each row's tokens and draft up to ``rows.ks[i]`` tokens (0: commit only)."""

    def end_step(self, rows: StepRows, sent: DraftBatch, looked_up: bool, prefetch_next: bool,
                 offload: bool = True) -> None:
        """``sent``: the drafts going to verification. ``prefetch_next``: the next step will look up.
        ``offload``: the step's work may run in the background during the forward (where the
        source ``offloads``), else in this call."""

    def lengths(self, drafts: DraftBatch, scale: float, fit: tuple[float, ...], min_gain: float, adaptive: bool,
                probe_tokens: int) -> tuple[Any, float, bool, bool]:
        """``ngramrl.core.batch.choose_lengths`` on this source's acceptance calibration."""

    def followed(self) -> tuple[int, int]:
        """Drafts followed to their end and their accepted tokens."""

    def calibration_state(self) -> list[list[float]]: ...

    def load_calibration_state(self, state: list[list[float]]) -> None: ...

    def export_history(self) -> Any | None:
        """The rollout history as plain data; None where it lives elsewhere and is saved there."""

    def restore_history(self, history: Any) -> int:
        """Take ``export_history``'s data in place of the history; returns the prompts now known."""

    def new_batch(self, prompts: dict[str, list[int]] | None = None) -> None:
        """A generate call starts; ``prompts`` (id -> prompt tokens): those its requests run, where
        the caller knows them."""

    def end_batch(self) -> None:
        """A generate call returned: no step follows until the next one, so the background's work
        for a next step stops."""

    def stats(self) -> dict[str, Any]:
        """The source's own counters, for the proposer's stats."""


class CoreSource:
    """The drafting core (native when built) in the engine process: it holds the history and the
    acceptance calibration (learned by following every draft it makes), which its outcome model
    and its choice of draft lengths read. ``k``: the most draft tokens a step verifies per
    request; ``background``: the step's inserts and the prefetch of the next drafts run during the
    forward; ``budget_grows``: the forward leaves a core idle, so the prefetch's budget follows the
    time it had (``next_budget``); ``threads``: the core's threads for a step; ``cores``: where its
    workers run (the CPU cores the forward leaves idle; empty: anywhere)."""

    def __init__(self, config: NgramRLConfig, drafter: DrafterConfig, k: int, background: bool,
                 budget_grows: bool = False, threads: int = 1, cores: Collection[int] = ()) -> None:
        self.core = make_core(config.history, drafter, config.prefetch, threads=threads, follow=True, cores=cores)
        self.k = k
        self.offloads = background
        self.prefetch = config.prefetch  # the configured budget, the floor of the one in effect
        self.budget_grows = budget_grows  # the forward leaves a core idle: the budget may follow its length
        self._budget_sum = self._prefetches = 0  # the budgets the prefetches ran with, and the prefetches

    @property
    def budget(self) -> int:
        """The per-request budget in effect (the core's; ``next_budget`` moves it)."""
        return self.core.prefetch_config.budget

    def start_many(self, req_ids: list[str], prompt_ids: list[str], prompts: list[list[int]],
                   befores: list[list[int]]) -> list[int]:
        return self.core.start_many(prompt_ids, prompts, befores, register=True)

    def finish_many(self, requests: list[int], epochs: list[int]) -> None:
        self.core.finish_many(requests, epochs)

    def begin_step(self) -> None:
        """Stop the prefetch (its finished lookups are kept for this step), and set the next one's
        budget from the time it had (``next_budget``)."""
        if self.offloads:
            self.core.stop(cancel=True)
            span = self.core.take_span()
            if span is not None and self.budget_grows:
                budget = next_budget(self.budget, self.prefetch, span)
                if budget != self.budget:
                    self.core.set_budget(budget)

    def draft(self, rows: StepRows) -> DraftBatch:
        """All rows in one call of the core. A row without room (k = 0: drafting does not pay at
        this batch size) only keeps its tokens: the next step that drafts indexes the backlog in
        one go, when the automaton is in the caches, not flushed by a forward (at 32 requests in
        flight this took a quarter off the proposer's mean time per step; docs/vllm.md)."""
        return self.core.step(rows.requests, rows.tokens, rows.offsets, rows.ks)

    def end_step(self, rows: StepRows, sent: DraftBatch, looked_up: bool, prefetch_next: bool,
                 offload: bool = True) -> None:
        """After a step with lookups its committed tokens enter the index: in the background during
        the forward, with the next drafts of the likeliest outcomes prefetched after them, where
        the forward leaves a core idle and the proposer ``offload``s; otherwise at once (a
        background thread on the forward's cores would slow it, and waking one costs more than a
        few rows' work). A step without lookups leaves them for the next one that looks up (a
        worker woken for the inserts alone measured 1.3% slower than synchronous drafting at 32
        requests in flight; docs/vllm.md), except the step just before it: there the backlog
        enters the index during the forward, and every row's next draft is prefetched as after
        an empty draft (the outcome is the next token alone), so that a lookup step after steps
        without drafting (a probe of the step-cost model, or drafting coming back) does not
        index and look up the whole batch in its own call."""
        if not (self.offloads and offload):
            self.core.stop()  # the finished requests' work, now: not on the forward's cores
            if len(rows) and looked_up:
                self.core.absorb(rows.requests, now=True)
            return
        if not len(rows) or not (looked_up or prefetch_next):
            return
        handles = rows.requests
        if not prefetch_next:
            self.core.absorb(handles)
            return
        chosen = rows.prefetched(looked_up)
        if chosen is None:
            looked, offsets = handles, sent.offsets
        else:
            looked = np.asarray(handles, dtype=np.int64)[chosen]
            offsets = np.append(sent.offsets[:-1][chosen], sent.offsets[-1])
        self.core.prefetch(looked, sent.tokens, offsets, sent.probs, self.k, absorb=handles)
        self._budget_sum += self.budget
        self._prefetches += 1

    def lengths(self, drafts: DraftBatch, scale: float, fit: tuple[float, ...], min_gain: float, adaptive: bool,
                probe_tokens: int) -> tuple[Any, float, bool, bool]:
        return self.core.lengths(drafts.probs, drafts.offsets, scale, fit, min_gain, adaptive, probe_tokens)

    def followed(self) -> tuple[int, int]:
        return self.core.followed()

    def calibration_state(self) -> list[list[float]]:
        return self.core.calibration_state()

    def load_calibration_state(self, state: list[list[float]]) -> None:
        self.core.load_calibration_state(state)

    def export_history(self) -> Any:
        return self.core.export()

    def restore_history(self, history: Any) -> int:
        self.core.clear()
        self.core.restore(history)
        return len(self.core)

    def new_batch(self, prompts: dict[str, list[int]] | None = None) -> None:
        pass

    def end_batch(self) -> None:
        if self.offloads:
            self.core.stop(cancel=True)
            self.core.take_span()  # the time until the next call is no forward: the budget must not follow it

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = {"prompts": len(self.core), "native_core": self.core.native}
        timings = self.core.timings() if self.core.native else None
        if self.offloads and timings is not None:
            stats.update(prefetch_dispatched=timings["prefetch_lookups"], prefetch_failed=0,
                         prefetch_plan_us_median=timings["plan_ns"] / 1000 / max(1, timings["plan_rows"]),
                         prefetch_budget=self.budget)
            if self._prefetches:
                stats["prefetch_budget_mean"] = self._budget_sum / self._prefetches
        return stats

