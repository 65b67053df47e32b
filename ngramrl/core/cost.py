"""How long to draft: a step-cost model, not a fixed k.

Verifying d draft tokens makes the target's forward process d more tokens. When the forward is
memory-bound (a GPU at small batch) that is almost free; when it is compute-bound (large batches,
or a CPU from the start) every verified token costs time, and a draft token that will probably be
rejected makes the step slower than it saves. The model:

- ``StepCostModel`` fits the step time online as ``base + per_request * requests + per_token *
  draft tokens + per_verify * [any draft token]`` (exponentially weighted least squares): what a
  step costs for its requests alone, what each verified draft token adds, and what a step pays
  once for verifying at all (the rejection sampler and its bookkeeping; a step without drafts
  samples like a step without speculation).
- ``choose_draft_lengths`` keeps a draft token only while it raises the expected throughput:
  with N expected committed tokens in time T, one more draft token that survives with chance s
  is worth it iff (N + s) / (T + per_token) > N / T, i.e. s > per_token * N / T. Survival chances
  decrease along a draft, so tokens are taken best first across the batch. Then the whole set is
  kept only if it beats verifying nothing, which saves ``per_verify``.
- Both tests ask for a margin (``min_gain``, e.g. 10%): the fit and the survival chances are
  estimates, and a draft that only breaks even on paper loses when either is a little off. So
  speculation stays off unless it is clearly ahead, which is what keeps it from ever being
  slower than no speculation at large batches.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

FEATURES = 4  # 1, requests, draft tokens, any draft token


class StepCostModel:
    def __init__(self, decay: float = 0.98, ridge: float = 1e-9) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = decay
        self.ridge = ridge
        self._xtx = np.zeros((FEATURES, FEATURES))
        self._xty = np.zeros(FEATURES)
        self._solved: tuple[float, float, float, float] | None = None
        self.steps = 0

    def observe(self, requests: int, draft_tokens: int, seconds: float) -> None:
        x = np.array([1.0, float(requests), float(draft_tokens), float(draft_tokens > 0)])
        self._xtx = self.decay * self._xtx + np.outer(x, x)
        self._xty = self.decay * self._xty + x * seconds
        self._solved = None
        self.steps += 1

    @property
    def coefficients(self) -> tuple[float, float, float, float]:
        """(base, per request, per draft token, per verifying step) in seconds; zeros until two
        steps are seen. A coefficient the data cannot tell apart yet (no variation in its
        feature) comes out near zero, so an unexplored cost is never assumed."""
        if self.steps < 2:
            return (0.0, 0.0, 0.0, 0.0)
        if self._solved is None:
            scale = max(1.0, float(np.trace(self._xtx)))
            solution = np.linalg.solve(self._xtx + self.ridge * scale * np.eye(FEATURES), self._xty)
            base, per_request, per_token, per_verify = (max(0.0, float(v)) for v in solution)
            self._solved = (base, per_request, per_token, per_verify)
        return self._solved

    def step_time(self, requests: int, draft_tokens: int) -> float:
        base, per_request, per_token, per_verify = self.coefficients
        return base + per_request * requests + per_token * draft_tokens + per_verify * (draft_tokens > 0)

    def state(self) -> dict[str, Any]:
        """The fit as plain data (to carry it to a new engine; ``load_state`` takes it back)."""
        return {"xtx": self._xtx.tolist(), "xty": self._xty.tolist(), "steps": self.steps}

    def load_state(self, state: dict[str, Any]) -> None:
        self._xtx = np.array(state["xtx"], dtype=float).reshape(FEATURES, FEATURES)
        self._xty = np.array(state["xty"], dtype=float).reshape(FEATURES)
        self.steps = int(state["steps"])
        self._solved = None

    def drafting_can_pay(self, requests: int, min_gain: float = 0.0) -> bool:
        """Whether any drafts could raise throughput at this batch size: even tokens certain to be
        accepted pay only if 1 > per_token * N / T (the once-per-step verification cost spreads
        over many such tokens, so it is left out). When they cannot, drafts need not even be
        looked up."""
        base, per_request, per_token, per_verify = self.coefficients
        if per_token <= 0.0:
            return True
        return (1.0 + min_gain) * per_token * requests < base + per_request * requests


class FixedStepCost(StepCostModel):
    """A step-cost model with given coefficients that learns nothing: to replay or test the
    proposer's decisions under a known cost regime, apart from the fit."""

    def __init__(self, base: float, per_request: float, per_token: float, per_verify: float) -> None:
        super().__init__()
        self.fixed = (base, per_request, per_token, per_verify)

    def observe(self, requests: int, draft_tokens: int, seconds: float) -> None:
        pass

    @property
    def coefficients(self) -> tuple[float, float, float, float]:
        return self.fixed


def choose_draft_lengths(survival: Sequence[Sequence[float]], model: StepCostModel, min_gain: float = 0.0) -> list[int]:
    """Per request, how many leading draft tokens to verify. ``survival[r][i]``: the chance that
    draft tokens 0..i of request r are all accepted (non-increasing in i). A token must raise the
    expected throughput by ``min_gain`` (relative) at the margin, and the whole set must beat
    verifying nothing by as much."""
    demand = 1.0 + min_gain
    base, per_request, per_token, per_verify = model.coefficients
    if per_token <= 0.0 and per_verify <= 0.0:
        return [len(s) for s in survival]
    lengths = [0] * len(survival)
    plain = float(len(survival))                     # every request commits one token per step
    plain_time = base + per_request * len(survival)
    committed, time = plain, plain_time + per_verify
    for chance, r, i in _best_first(survival):
        if chance * time <= demand * per_token * committed:
            break  # the best remaining token does not pay for its verification
        lengths[r] = i + 1
        committed += chance
        time += per_token
    if committed * plain_time <= demand * plain * time:  # verifying at all costs more than the drafts save
        return [0] * len(survival)
    return lengths


def probe_lengths(survival: Sequence[Sequence[float]], tokens: int) -> list[int]:
    """The ``tokens`` likeliest draft tokens of the batch (each request's leading ones): a cheap
    verification that keeps the cost fit seeing what draft tokens cost while drafting is off."""
    lengths = [0] * len(survival)
    for _, r, i in itertools.islice(_best_first(survival), tokens):
        lengths[r] = i + 1
    return lengths


def _best_first(survival: Sequence[Sequence[float]]) -> Iterator[tuple[float, int, int]]:
    """(survival chance, request, token index) over the batch's draft tokens, likeliest first.
    Chances fall along a draft, so a request's next token is read only once its previous one is
    taken (lazy survival sequences are read no further than needed)."""
    heap = [(-s[0], r, 0) for r, s in enumerate(survival) if s]
    heapq.heapify(heap)
    while heap:
        negative, r, i = heapq.heappop(heap)
        yield -negative, r, i
        if i + 1 < len(survival[r]):
            heapq.heappush(heap, (-survival[r][i + 1], r, i + 1))
