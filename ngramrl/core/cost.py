"""How long to draft: a step-cost model, not a fixed k.

Verifying d draft tokens makes the target's forward process d more tokens. When the forward is
memory-bound (a GPU at small batch) that is almost free; when it is compute-bound (large batches,
or a CPU from the start) every verified token costs time, and a draft token that will probably be
rejected makes the step slower than it saves. The model:

- ``StepCostModel`` fits the step time online as ``base + per_request * requests + per_token *
  draft tokens`` (exponentially weighted least squares): what a step costs for its requests
  alone, and what each verified draft token adds.
- ``choose_draft_lengths`` keeps a draft token only while it raises the expected throughput:
  with N expected committed tokens in time T, one more draft token that survives with chance s
  is worth it iff (N + s) / (T + per_token) > N / T, i.e. s > per_token * N / T. Survival chances
  decrease along a draft, so tokens are taken best first across the batch.
"""

from __future__ import annotations

import heapq

import numpy as np


class StepCostModel:
    def __init__(self, decay: float = 0.98, ridge: float = 1e-9) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = decay
        self.ridge = ridge
        self._xtx = np.zeros((3, 3))
        self._xty = np.zeros(3)
        self.steps = 0

    def observe(self, requests: int, draft_tokens: int, seconds: float) -> None:
        x = np.array([1.0, float(requests), float(draft_tokens)])
        self._xtx = self.decay * self._xtx + np.outer(x, x)
        self._xty = self.decay * self._xty + x * seconds
        self.steps += 1

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """(base, per request, per draft token) in seconds; zeros until two steps are seen. A
        coefficient the data cannot tell apart yet (no variation in it) comes out near zero."""
        if self.steps < 2:
            return (0.0, 0.0, 0.0)
        scale = max(1.0, float(np.trace(self._xtx)))
        solution = np.linalg.solve(self._xtx + self.ridge * scale * np.eye(3), self._xty)
        base, per_request, per_token = (float(v) for v in solution)
        return (max(0.0, base), max(0.0, per_request), max(0.0, per_token))

    def step_time(self, requests: int, draft_tokens: int) -> float:
        base, per_request, per_token = self.coefficients
        return base + per_request * requests + per_token * draft_tokens


def choose_draft_lengths(survival: list[list[float]], model: StepCostModel) -> list[int]:
    """Per request, how many leading draft tokens to verify. ``survival[r][i]``: the chance that
    draft tokens 0..i of request r are all accepted (non-increasing in i)."""
    base, per_request, per_token = model.coefficients
    lengths = [0] * len(survival)
    if per_token <= 0.0:
        return [len(s) for s in survival]
    committed = float(len(survival))            # every request commits one token per step
    time = base + per_request * len(survival)
    heap = [(-s[0], r, 0) for r, s in enumerate(survival) if s]
    heapq.heapify(heap)
    while heap:
        negative, r, i = heapq.heappop(heap)
        chance = -negative
        if chance * time <= per_token * committed:
            break  # the best remaining token does not pay for its verification
        lengths[r] = i + 1
        committed += chance
        time += per_token
        if i + 1 < len(survival[r]):
            heapq.heappush(heap, (-survival[r][i + 1], r, i + 1))
    return lengths
