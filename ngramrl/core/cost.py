"""How long to draft: a step-cost model, not a fixed k.

Verifying d draft tokens makes the target's forward process d more tokens. When the forward is
memory-bound (a GPU at small batch) that is almost free; when it is compute-bound (large batches,
or a CPU from the start) every verified token costs time, and a draft token that will probably be
rejected makes the step slower than it saves. The model:

- ``StepCostModel`` fits the step time as ``base + per_token * tokens`` online (exponentially
  weighted least squares over the steps seen so far), from the tokens each step verified.
- ``choose_draft_lengths`` keeps a draft token only while it raises the expected throughput:
  with N expected committed tokens in time T, one more draft token that survives with chance s
  is worth it iff (N + s) / (T + per_token) > N / T, i.e. s > per_token * N / T. Survival chances
  decrease along a draft, so tokens are taken best first across the batch.
"""

from __future__ import annotations

import heapq


class StepCostModel:
    def __init__(self, decay: float = 0.98, prior_base: float = 1e-3, prior_per_token: float = 0.0) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = decay
        self._sw = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self._prior = (prior_base, prior_per_token)
        self.steps = 0

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self._sw = d * self._sw + 1.0
        self._sx = d * self._sx + tokens
        self._sy = d * self._sy + seconds
        self._sxx = d * self._sxx + tokens * tokens
        self._sxy = d * self._sxy + tokens * seconds
        self.steps += 1

    @property
    def coefficients(self) -> tuple[float, float]:
        """(base seconds, seconds per verified token); the prior until the data can tell them apart."""
        if self._sw < 2:
            return self._prior
        mean_x, mean_y = self._sx / self._sw, self._sy / self._sw
        var_x = self._sxx / self._sw - mean_x * mean_x
        if var_x <= 1e-9 * max(1.0, mean_x * mean_x):
            return (max(0.0, mean_y - self._prior[1] * mean_x), self._prior[1])
        per_token = (self._sxy / self._sw - mean_x * mean_y) / var_x
        per_token = max(0.0, per_token)
        return (max(0.0, mean_y - per_token * mean_x), per_token)

    def step_time(self, tokens: int) -> float:
        base, per_token = self.coefficients
        return base + per_token * tokens


def choose_draft_lengths(survival: list[list[float]], model: StepCostModel) -> list[int]:
    """Per request, how many leading draft tokens to verify. ``survival[r][i]``: the chance that
    draft token i of request r is accepted (non-increasing in i)."""
    base, per_token = model.coefficients
    lengths = [0] * len(survival)
    committed = float(len(survival))            # every request commits one token per step
    time = base + per_token * len(survival)     # each request's own token is verified too
    if per_token <= 0.0:
        return [len(s) for s in survival]
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
