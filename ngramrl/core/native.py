"""``NativeCore``: the batch interface of ``ngramrl.core.batch`` over the C++ core (``ngramrl._native``).

Inputs are checked here (shapes, offsets, duplicate handles) and converted to contiguous arrays
once; the C++ side releases the GIL for the work. See docs/native.md for the layout and threads.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from ngramrl.config import DrafterConfig, HistoryConfig, PrefetchConfig
from ngramrl.core.cost import checked_fit
from ngramrl.core.drafter import Draft
from ngramrl.core.outcome import PrefetchSpan, allocation
from ngramrl.core.rows import SOURCES, DraftBatch, OutcomeBatch


def _budget_args(prefetch: PrefetchConfig) -> tuple[int, int]:
    """The C++ core's budget: the most outcomes one request gets, and the batch's total per planned
    request (-1 without a shared budget), as ``outcome.allocation`` says."""
    limit, shared = allocation(prefetch)
    return limit, prefetch.budget if shared else -1


class NativeCore:
    native = True

    def __init__(self, module: Any, history: HistoryConfig | None = None, drafter: DrafterConfig | None = None,
                 prefetch: PrefetchConfig | None = None, threads: int = 1, follow: bool = False,
                 cores: Collection[int] = ()) -> None:
        history = history or HistoryConfig()
        drafter = drafter or DrafterConfig()
        prefetch = prefetch or PrefetchConfig()
        if threads < 1:
            raise ValueError(f"NativeCore threads must be >= 1, got {threads}")
        self.history_config, self.drafter_config, self.prefetch_config = history, drafter, prefetch
        self.threads = threads
        self.cores = frozenset(int(c) for c in cores)
        limit, shared_budget = _budget_args(prefetch)
        self._core = module.Core(
            rollouts_per_prompt=history.rollouts_per_prompt, epochs_kept=history.epochs_kept,
            max_tokens=history.max_tokens, prompt_tail=history.prompt_tail,
            max_draft=drafter.max_draft, min_confidence=drafter.min_confidence, min_match=drafter.min_match,
            rematch_tokens=drafter.rematch_tokens, use_global=drafter.use_global, draft_levels=drafter.levels,
            path_width=drafter.path_width,
            stop_tokens=[int(t) for t in drafter.stop_tokens],
            budget=limit, global_budget=-1 if prefetch.global_budget is None else prefetch.global_budget,
            shared_budget=shared_budget, plan_floor=prefetch.plan_floor,
            min_probability=prefetch.min_probability, levels=prefetch.levels,
            prior_strength=prefetch.prior_strength, calibration_decay=prefetch.calibration_decay, threads=threads,
            follow=follow, cores=sorted(self.cores))

    # -- history ---------------------------------------------------------------------------

    def add_rollout(self, prompt_id: str, prompt: Any, output: Any, epoch: int) -> None:
        self._core.add_rollout(str(prompt_id), prompt, output, int(epoch))

    def export(self, prompt_ids: list[str] | None = None) -> list[list]:
        found = self._core.export() if prompt_ids is None else self._core.export_prompts(list(prompt_ids))
        return [[prompt_id, list(prompt), [[epoch, list(tokens)] for epoch, tokens in rollouts]]
                for prompt_id, prompt, rollouts in found]

    def restore(self, exported: list[list], replace: bool = False) -> None:
        for prompt_id, prompt, rollouts in exported:
            self._core.restore_prompt(str(prompt_id), [int(t) for t in prompt],
                                      [(int(epoch), [int(t) for t in tokens]) for epoch, tokens in rollouts], replace)

    def clear(self) -> None:
        self._core.clear()

    @property
    def stored_tokens(self) -> int:
        return self._core.stored_tokens()

    def __len__(self) -> int:
        return self._core.num_prompts()

    def prompt_ids(self) -> list[str]:
        return self._core.prompt_ids()

    def rollout_count(self, prompt_id: str) -> int:
        return self._core.rollout_count(prompt_id)

    def counters(self) -> dict[str, int]:
        return dict(self._core.counters())

    def build_indexes(self) -> None:
        self._core.build_indexes()

    def index_prompt(self, prompt_id: str) -> bool:
        """Build the prompt's index now (it becomes the most recently used); False if unknown."""
        return self._core.index_prompt(str(prompt_id))

    def index_shape(self, prompt_id: str | None = None) -> tuple[int, int, int]:
        """(states, tokens, sequences) of a prompt's index (None: the cross-prompt one); -1s when not built."""
        return tuple(self._core.index_shape("" if prompt_id is None else str(prompt_id)))

    def followed(self) -> tuple[int, int]:
        """Drafts followed to their end and their accepted tokens (``follow``)."""
        return tuple(self._core.followed())

    def timings(self) -> dict[str, int]:
        """Nanoseconds spent in steps, background inserts, outcome planning and prefetch lookups, and
        the rows each covered, since the core was made."""
        return dict(self._core.timings())

    def memory_bytes(self) -> int:
        """Bytes the core's C++ structures hold (capacities plus the allocator's bookkeeping)."""
        return self._core.memory_bytes()

    # -- requests --------------------------------------------------------------------------

    def start(self, prompt_id: str, prompt: Any, output: Any = (), register: bool = False) -> int:
        return self.start_many([prompt_id], [prompt], [output], register)[0]

    def start_many(self, prompt_ids: Sequence[str], prompts: Sequence[Any], outputs: Sequence[Any],
                   register: bool = False) -> list[int]:
        """``ReferenceCore.start_many``: the tokens are read from the lists (or arrays) as they are."""
        return self._core.start([str(p) for p in prompt_ids], prompts, outputs, bool(register))

    def finish(self, handle: int, epoch: int | None = None, linger: bool = False) -> None:
        self.finish_many([handle], None if epoch is None else [epoch], linger)

    def finish_many(self, handles: Sequence[int], epochs: Sequence[int] | None = None, linger: bool = False) -> None:
        """``ReferenceCore.finish_many``: one background job for all of them."""
        if epochs is not None and any(isinstance(e, bool) for e in epochs):
            raise ValueError(f"epochs must be integers, got {list(epochs)!r}")
        self._core.finish([int(h) for h in handles], epochs is not None,
                          [] if epochs is None else [int(e) for e in epochs], bool(linger))

    def drop_ended(self, prompt_ids: Sequence[str]) -> None:
        """``ReferenceCore.drop_ended``, after the requests' background ends."""
        self._core.drop_ended([str(p) for p in prompt_ids])

    def known(self, handle: int) -> bool:
        return self._core.known(int(handle))

    # -- steps -----------------------------------------------------------------------------

    def step(self, handles: Any, tokens: Any, offsets: Any, ks: Any) -> DraftBatch:
        # The core checks the rows (as ``as_rows`` does) in one pass, before it changes anything.
        return DraftBatch(*self._core.step(handles, tokens, offsets, ks))

    def absorb(self, handles: Any, now: bool = False) -> None:
        """The rows' committed tokens enter the index: in the background (``now``: before returning)."""
        self._core.absorb(np.ascontiguousarray(handles, dtype=np.int64).reshape(-1), bool(now))

    def continuations(self, prompt_id: str, prompt: Any, output: Any, m: int) -> list[tuple[int, int]]:
        return [tuple(pair) for pair in self._core.continuations(str(prompt_id), prompt, output, int(m))]

    def lookup_context(self, prompt_id: str, prompt: Any, output: Any, k: int) -> Draft:
        tokens, probs, matched, source = self._core.lookup_context(str(prompt_id), prompt, output,
                                                                   int(k))
        return Draft(tokens, probs, matched, SOURCES[source])

    def prefetch(self, handles: Any, tokens: Any, offsets: Any, probs: Any, k: int, absorb: Any = ()) -> None:
        self._core.prefetch(handles, tokens, offsets, probs, int(k), np.ascontiguousarray(absorb, dtype=np.int64))

    def wait_idle(self, seconds: float) -> bool:
        """Wait at most ``seconds`` for the background work (inserts, prefetch); whether it finished."""
        return bool(self._core.wait_idle(float(seconds)))

    def stop(self, cancel: bool = False) -> None:
        """Wait for the background work (``cancel``: stop the prefetch lookups not yet started);
        what the prefetch found stays for the next step."""
        self._core.stop(bool(cancel))

    def set_budget(self, budget: int) -> None:
        """Prefetch with ``budget`` lookups per request from now on (``PrefetchConfig.budget``'s
        meaning; the rest of the config stays)."""
        self.prefetch_config = replace(self.prefetch_config, budget=int(budget))
        self._core.set_budget(*_budget_args(self.prefetch_config))

    def take_span(self) -> PrefetchSpan | None:
        """The last background prefetch a cancelling ``stop`` ended (once), or None."""
        span = self._core.take_span()
        if span is None:
            return None
        chosen, done, work_ns, window_ns = span
        return PrefetchSpan(int(chosen), int(done), work_ns / 1e9, window_ns / 1e9)

    def collect(self, cancel: bool = False) -> OutcomeBatch:
        """Wait for the background work (``cancel``: stop the prefetch lookups not yet started) and
        return the outcomes the last prefetch looked up."""
        rows, accepted, token, probability, tokens, offsets, probs, matched, source = self._core.collect(bool(cancel))
        drafts = DraftBatch(tokens, offsets, probs, matched, source, np.zeros(len(rows), dtype=bool))
        return OutcomeBatch(rows, accepted, token, probability, drafts)

    # -- calibration -----------------------------------------------------------------------

    def observe(self, probs: Any, offsets: Any, accepted: Any) -> None:
        self._core.observe(np.asarray(probs, dtype=np.float64), np.asarray(offsets, dtype=np.int64),
                           np.asarray(accepted, dtype=np.int64))

    def chances(self, probs: Any, offsets: Any) -> np.ndarray:
        return self._core.chances(np.asarray(probs, dtype=np.float64), np.asarray(offsets, dtype=np.int64))

    def lengths(self, probs: Any, offsets: Any, scale: float, fit: Sequence[float], min_gain: float,
                adaptive: bool = True, probe_tokens: int = 0) -> tuple[np.ndarray, float, bool, bool]:
        """``ngramrl.core.batch.choose_lengths`` on this core's calibration, in C++."""
        return self._core.lengths(probs, offsets, float(scale), [float(v) for v in checked_fit(fit)],
                                  float(min_gain), bool(adaptive), int(probe_tokens))

    def calibration_state(self) -> list[list[float]]:
        return self._core.calibration_state()

    def load_calibration_state(self, state: list[list[float]]) -> None:
        self._core.load_calibration_state([[float(v) for v in cell] for cell in state])

    def close(self) -> None:
        self._core.stop(True)
