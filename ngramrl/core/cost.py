"""How long to draft: a step-cost model, not a fixed k.

Verifying d draft tokens makes the target's forward process d more tokens. When the forward is
memory-bound (a GPU at small batch) that is almost free; when it is compute-bound (large batches,
or a CPU from the start) every verified token costs time, and a draft token that will probably be
rejected makes the step slower than it saves. The model:

- ``StepCostModel`` fits the step time online as ``base + per_request * requests + per_token *
  excess + per_verify * [any draft token]`` (exponentially weighted least squares): what a step
  costs for its requests alone, what each verified draft token adds, and what a step pays once
  for verifying at all (the rejection sampler and its bookkeeping; a step without drafts samples
  like a step without speculation). ``excess`` is the draft tokens beyond the forward's
  memory-bound plateau: a forward that reads its weights once costs about the same for any number
  of tokens up to a knee (a few hundred on a GPU), then more per token. With ``knee`` tokens in
  the plateau, a step of r requests and d draft tokens has ``excess = max(0, r + d - knee) -
  max(0, r - knee)``; a knee of 0 (every token costs, as on a CPU) makes it d. The knee is chosen
  among candidates by the fit's residuals, and only where it explains the steps clearly better
  than no plateau: so a CPU's fit is the plain linear one.
- ``choose_draft_lengths`` keeps a draft token only while it raises the expected throughput:
  with N expected committed tokens in time T, one more draft token that survives with chance s
  and adds m to the step is worth it iff (N + s) / (T + m) > N / T, i.e. s > m * N / T (m is
  zero inside the plateau, per_token past it). Survival chances decrease along a draft, so
  tokens are taken best first across the batch. Then the whole set is kept only if it beats
  verifying nothing, which saves ``per_verify``.
- Both tests ask for a margin (``min_gain``, e.g. 10%): the fit and the survival chances are
  estimates, and a draft that only breaks even on paper loses when either is a little off. A
  token must survive with (1 + min_gain) times the chance that pays for it; the whole set is
  kept only if it still beats verifying nothing with its expected tokens taken at 1 / (1 +
  min_gain) and the time it adds at (1 + min_gain) times the fit's. So where verifying costs
  something (CPUs, large batches) speculation stays off unless it is clearly ahead, which keeps
  it from being slower than no speculation there, and where verifying is nearly free (a GPU's
  plateau) any draft expected to bring tokens is verified.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ngramrl.core.extension import native_module

FEATURES = 4  # 1, requests, draft tokens past the plateau, any draft token
# Knees (tokens a step holds before it gets dearer) the fit chooses among: 0 (no plateau), then
# 4 to 8192 in steps of 2^(1/4) (about 19%).
KNEES = (0,) + tuple(sorted({int(round(4 * 2 ** (i / 4))) for i in range(45)}))
PLATEAU_GAIN = 0.2  # a knee is chosen only if it leaves this much less squared error than no plateau


def excess_tokens(requests: int, draft_tokens: float, knee: int) -> float:
    """Draft tokens of a step past the forward's plateau of ``knee`` tokens."""
    return max(0, requests + draft_tokens - knee) - max(0, requests - knee)


class StepCostModel:
    """The fit; ``refit_every``: steps observed between two solves (the fit moves slowly, with a
    memory of about 1 / (1 - decay) steps, and solving it for every knee each step is the larger
    part of what the model costs per step). Observations are folded into the sums when it is solved."""

    def __init__(self, decay: float = 0.98, ridge: float = 1e-9, refit_every: int = 1) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if refit_every < 1:
            raise ValueError(f"refit_every must be >= 1, got {refit_every}")
        self.decay = decay
        self.ridge = ridge
        self.refit_every = refit_every
        self._knees = np.array(KNEES, dtype=float)
        self._xtx = np.zeros((len(KNEES), FEATURES, FEATURES))
        self._xty = np.zeros((len(KNEES), FEATURES))
        self._yty = 0.0
        self._unfolded: list[tuple[float, float, float]] = []  # (requests, draft tokens, seconds), oldest first
        self._solved: tuple[tuple[float, float, float, float], int] | None = None
        self.steps = 0

    def observe(self, requests: int, draft_tokens: int, seconds: float) -> None:
        self._unfolded.append((float(requests), float(draft_tokens), float(seconds)))
        self.steps += 1
        if len(self._unfolded) >= self.refit_every:
            self._solved = None

    def _fold(self) -> None:
        """Add the observations not yet in the sums, each weighted by the decay since it was made
        (in C++ where the extension is built: ``ngramrl/native/cost.hpp``, the same sums)."""
        if not self._unfolded:
            return
        observed = np.array(self._unfolded, dtype=float)
        self._unfolded.clear()
        native = native_module()
        if native is not None:
            self._yty = native.step_cost_fold(self._xtx, self._xty, self._yty, observed, self._knees, self.decay)
            return
        requests, drafts, seconds = observed[:, 0:1], observed[:, 1:2], observed[:, 2]
        x = np.empty((len(observed), len(KNEES), FEATURES))
        x[:, :, 0] = 1.0
        x[:, :, 1] = requests
        x[:, :, 2] = np.maximum(0.0, requests + drafts - self._knees) - np.maximum(0.0, requests - self._knees)
        x[:, :, 3] = drafts > 0
        weights = self.decay ** np.arange(len(observed) - 1, -1, -1, dtype=float)
        aged = self.decay ** len(observed)
        self._xtx = aged * self._xtx + np.einsum("m,mkf,mkg->kfg", weights, x, x)
        self._xty = aged * self._xty + np.einsum("m,mkf,m->kf", weights, x, seconds)
        self._yty = aged * self._yty + float(np.sum(weights * seconds * seconds))

    def _solve(self) -> tuple[tuple[float, float, float, float], int]:
        """Least squares for every candidate knee; the knee whose fit leaves clearly less error than
        no plateau (``PLATEAU_GAIN``), else none."""
        if self._solved is None:
            self._fold()
            solution, errors = solve_knees(self._xtx, self._xty, self._yty, self.ridge)
            best = int(np.argmin(errors))
            if best and errors[best] > (1.0 - PLATEAU_GAIN) * errors[0]:
                best = 0
            base, per_request, per_token, per_verify = (max(0.0, float(v)) for v in solution[best])
            self._solved = ((base, per_request, per_token, per_verify), KNEES[best])
        return self._solved

    @property
    def coefficients(self) -> tuple[float, float, float, float]:
        """(base, per request, per draft token past the plateau, per verifying step) in seconds;
        zeros until two steps are seen. A coefficient the data cannot tell apart yet (no variation
        in its feature) comes out near zero, so an unexplored cost is never assumed."""
        if self.steps < 2:
            return (0.0, 0.0, 0.0, 0.0)
        return self._solve()[0]

    @property
    def knee(self) -> int:
        """Tokens (requests plus draft tokens) a step holds before each one costs ``per_token``."""
        return 0 if self.steps < 2 else self._solve()[1]

    @property
    def fit(self) -> tuple[float, float, float, float, int]:
        """The coefficients and the knee in one tuple: what the drafting core's ``lengths`` reads."""
        return (*self.coefficients, self.knee)

    def step_time(self, requests: int, draft_tokens: float) -> float:
        base, per_request, per_token, per_verify = self.coefficients
        return (base + per_request * requests + per_token * excess_tokens(requests, draft_tokens, self.knee)
                + per_verify * (draft_tokens > 0))

    def state(self) -> dict[str, Any]:
        """The fit as plain data (to carry it to a new engine; ``load_state`` takes it back)."""
        self._fold()
        return {"knees": list(KNEES), "xtx": self._xtx.tolist(), "xty": self._xty.tolist(), "yty": self._yty,
                "steps": self.steps}

    def load_state(self, state: dict[str, Any]) -> None:
        if list(state.get("knees", ())) != list(KNEES):
            raise ValueError("step-cost state was saved with other plateau candidates")
        self._xtx = np.array(state["xtx"], dtype=float).reshape(len(KNEES), FEATURES, FEATURES)
        self._xty = np.array(state["xty"], dtype=float).reshape(len(KNEES), FEATURES)
        self._yty = float(state["yty"])
        self.steps = int(state["steps"])
        self._unfolded.clear()
        self._solved = None

    def drafting_can_pay(self, requests: int, min_gain: float = 0.0) -> bool:
        """Whether any drafts could raise throughput at this batch size: a step with room left in
        its plateau verifies some tokens for free; past it, even tokens certain to be accepted pay
        only if 1 > per_token * N / T (the once-per-step verification cost spreads over many such
        tokens, so it is left out). When they cannot, drafts need not even be looked up."""
        base, per_request, per_token, per_verify = self.coefficients
        if per_token <= 0.0 or requests < self.knee:
            return True
        return (1.0 + min_gain) * per_token * requests < base + per_request * requests


def solve_knees(xtx: np.ndarray, xty: np.ndarray, yty: float, ridge: float) -> tuple[np.ndarray, np.ndarray]:
    """Each knee's least-squares coefficients (knees, FEATURES) and squared error (knees,) from its
    normal equations, regularized by ``ridge`` times the system's trace (at least 1); in C++ where
    the extension is built."""
    native = native_module()
    if native is not None:
        return native.step_cost_solve(xtx, xty, yty, ridge)
    scale = np.maximum(1.0, np.trace(xtx, axis1=1, axis2=2))[:, None, None]
    solution = np.linalg.solve(xtx + ridge * scale * np.eye(FEATURES), xty[:, :, None])[:, :, 0]
    errors = yty - 2.0 * np.einsum("kf,kf->k", solution, xty) + np.einsum("kf,kfg,kg->k", solution, xtx, solution)
    return solution, errors


class FixedStepCost(StepCostModel):
    """A step-cost model with given coefficients that learns nothing: to replay or test the
    proposer's decisions under a known cost regime, apart from the fit."""

    def __init__(self, base: float, per_request: float, per_token: float, per_verify: float, knee: int = 0) -> None:
        super().__init__()
        self.fixed = (base, per_request, per_token, per_verify)
        self.fixed_knee = knee

    def observe(self, requests: int, draft_tokens: int, seconds: float) -> None:
        pass

    @property
    def coefficients(self) -> tuple[float, float, float, float]:
        return self.fixed

    @property
    def knee(self) -> int:
        return self.fixed_knee


def drafting_pays(model: StepCostModel, requests: int, draft_tokens: float, expected_accepted: float,
                  drafting_s: float, plain_s: float, min_gain: float = 0.0) -> bool:
    """Whether a step that looks up and verifies drafts beats one that does neither by ``min_gain``,
    the proposer's own time included (it is on a synchronous engine's critical path): the drafts
    verify ``draft_tokens`` tokens expected to add ``expected_accepted`` committed tokens, the
    proposer takes ``drafting_s`` in such a step and ``plain_s`` in a step without lookups."""
    with_drafts = model.step_time(requests, draft_tokens) + drafting_s
    without = model.step_time(requests, 0) + plain_s
    if with_drafts <= 0.0 or without <= 0.0:
        return True  # nothing measured yet
    return (requests + expected_accepted) * without > (1.0 + min_gain) * requests * with_drafts


def fit_plateau(points: Sequence[tuple[int, float]]) -> tuple[float, float, float]:
    """(time without drafts, seconds per draft token past the plateau, draft tokens inside it) of
    step times at one batch size, ``points`` = (draft tokens, seconds): the least-squares fit of
    ``t = base + per_token * max(0, d - free)`` over breakpoints at and between the points."""
    if not points:
        raise ValueError("no points to fit")
    drafts = np.array([float(d) for d, _ in points])
    seconds = np.array([float(t) for _, t in points])
    known = sorted({0.0, *drafts.tolist()})
    candidates = sorted({*known, *(a + (b - a) * i / 16 for a, b in zip(known, known[1:], strict=False)
                                  for i in range(1, 16))})
    best: tuple[float, float, float, float] | None = None
    for free in candidates:
        x = np.maximum(0.0, drafts - free)
        design = np.stack([np.ones_like(x), x], axis=1)
        (base, per_token), *_ = np.linalg.lstsq(design, seconds, rcond=None)
        per_token = max(0.0, float(per_token))
        error = float(np.sum((base + per_token * x - seconds) ** 2))
        if best is None or error < best[0] * (1.0 - 1e-9):
            best = (error, float(base), per_token, free if per_token > 0 else float(drafts.max()))
    _, base, per_token, free = best
    return base, per_token, free


def choose_draft_lengths(survival: Sequence[Sequence[float]], model: StepCostModel, min_gain: float = 0.0) -> list[int]:
    """Per request, how many leading draft tokens to verify. ``survival[r][i]``: the chance that
    draft tokens 0..i of request r are all accepted (non-increasing in i). A token must raise the
    expected throughput by ``min_gain`` (relative) at the margin, and the whole set must beat
    verifying nothing by as much."""
    demand = 1.0 + min_gain
    base, per_request, per_token, per_verify = model.coefficients
    if per_token <= 0.0 and per_verify <= 0.0:
        return [len(s) for s in survival]
    requests = len(survival)
    free = max(0, model.knee - requests)              # draft tokens inside the plateau
    lengths = [0] * requests
    plain = float(requests)                           # every request commits one token per step
    plain_time = base + per_request * requests
    committed, time, taken = plain, plain_time + per_verify, 0
    for chance, r, i in _best_first(survival):
        cost = per_token if taken >= free else 0.0
        if chance * time <= demand * cost * committed:
            break  # the best remaining token does not pay for its verification
        lengths[r] = i + 1
        committed += chance
        time += cost
        taken += 1
    # The whole set must pay for verifying at all, its expected tokens taken at 1 / demand of
    # their estimate and its added time at demand times the fit's.
    if (plain + (committed - plain) / demand) * plain_time <= plain * (plain_time + demand * (time - plain_time)):
        return [0] * requests
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


def checked_fit(fit: Sequence[float]) -> tuple[float, float, float, float, int]:
    """A ``StepCostModel.fit`` tuple, checked: (base, per request, per token, per verify, knee)."""
    if len(fit) != 5:
        raise ValueError(f"a step-cost fit is (base, per request, per token, per verify, knee), got {tuple(fit)}")
    base, per_request, per_token, per_verify, knee = fit
    if knee < 0 or knee != int(knee):
        raise ValueError(f"the step-cost fit's knee must be a whole number of tokens >= 0, got {knee}")
    return float(base), float(per_request), float(per_token), float(per_verify), int(knee)


def step_cost(fit: Sequence[float]) -> FixedStepCost:
    """The step-cost model a ``StepCostModel.fit`` tuple describes."""
    *coefficients, knee = checked_fit(fit)
    return FixedStepCost(*coefficients, knee)
