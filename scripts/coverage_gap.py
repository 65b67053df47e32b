"""Where prefetch coverage is lost: the outcome model's calibration, and what two other ways of
spending the budget would cover, on the replay of `ngramrl bench` (k = 16; docs/prefetch.md,
"Where the rest goes").

    python scripts/coverage_gap.py ngramrl/traces/gsm-smollm2-t0.6.jsonl.gz [--budget 16] [--candidates 64]

For each trace, over every warm step whose rollout goes on:
- coverage: the real outcome (j, b) among the budget's likeliest predicted outcomes (what
  `ngramrl bench` reports), and the ceiling (b had followed the last token in the history);
- by state: a lookup counted as ready when the real outcome reaches the same match states as one of
  those outcomes (the next draft is a function of the states, so they share it);
- P(j): the outcome model's mean P(j) against how often j happened, for j = 0..5;
- P(b | j) at the true j, by decile of the predicted probability: predicted against observed;
- re-ranked: the best a logistic model over (log P(j), log P(b | j), j, the rank of b at its j)
  does, fitted on the same steps it is scored on (an upper bound for recalibrating the scores
  with those features);
- known j: the budget's likeliest b at the true j (what the budget covers when j is known);
- designs: next-draft prefetch (the budget's lookups, as the engine's) against match-state
  prefetch (only the match states after d_1..d_j for the same j): how often each was ready for the
  real outcome, the CPU each spent per step, and the critical-path time each hid per unit of it
  (in the Python reference drafter, where both are timed side by side).

Run it from a checkout (the checkout's ngramrl is imported).
"""

from __future__ import annotations

import argparse
import collections
import math
import statistics
import sys

import numpy as np

sys.path.insert(0, ".")

from ngramrl.bench.methods import CoverageTally, ReferenceMethod  # noqa: E402
from ngramrl.bench.replay import replay  # noqa: E402
from ngramrl.config import PrefetchConfig  # noqa: E402
from ngramrl.core.drafter import Draft  # noqa: E402
from ngramrl.core.estimate import advance  # noqa: E402
from ngramrl.core.outcome import accepted_length_distribution  # noqa: E402
from ngramrl.core.trace import read_trace  # noqa: E402


class GapMethod(ReferenceMethod):
    """ngramrl's replay method that also keeps, per step, the predicted outcomes and the real one."""

    def __init__(self, budget: int, candidates: int) -> None:
        # The replay's own prediction lists ``candidates`` outcomes; the budget's are looked up.
        super().__init__(prefetch=PrefetchConfig(budget=budget), budgets=[candidates], known_j_budget=budget)
        self.steps: list[dict] = []
        self._pending: tuple | None = None

    def _predict(self, draft: Draft, k: int) -> None:
        super()._predict(draft, k)
        sources = self.drafter.outcome_sources(self.request)
        p_j = accepted_length_distribution(self.calibration.chances(draft.probs))
        outcomes = self._outcomes  # what it predicted, likeliest first
        states = [tuple(advance(index, match, draft.tokens[:o.accepted] + [o.token]).state for index, match in sources)
                  for o in outcomes]
        self._pending = (sources, p_j, outcomes, states)

    def commit(self, tokens: list[int]) -> None:
        # The indexes are those the prediction read until the next lookup's absorb: compare here.
        if self._pending is not None and self._remaining - len(tokens) > 0:
            sources, p_j, outcomes, states = self._pending
            self.steps.append({
                "j": len(tokens) - 1,
                "p_j": p_j,
                "outcomes": [(o.probability, o.accepted, o.token) for o in outcomes],
                "states": states,
                "real": (len(tokens) - 1, tokens[-1]),
                "real_state": tuple(advance(index, match, tokens).state for index, match in sources),
            })
        self._pending = None
        super().commit(tokens)


def logistic_bound(steps: list[dict], budget: int) -> float:
    """Coverage of the budget's best outcomes by a logistic score fitted on the same steps."""
    rows, hits, groups = [], [], []
    for n, step in enumerate(steps):
        rank_at_j: collections.Counter = collections.Counter()
        for p, j, b in step["outcomes"]:
            p_j = step["p_j"][j]
            rows.append([math.log(max(p_j, 1e-12)), math.log(max(p / p_j if p_j > 0 else 0.0, 1e-12)),
                         min(j, 6), math.log1p(rank_at_j[j]), 1.0])
            rank_at_j[j] += 1
            hits.append(float((j, b) == step["real"]))
            groups.append(n)
    if not rows:
        return 0.0
    x, y = np.array(rows), np.array(hits)
    w = np.zeros(x.shape[1])
    for _ in range(100):  # Newton's method on the log-likelihood
        p = 1.0 / (1.0 + np.exp(-(x @ w)))
        hessian = (x * (p * (1 - p))[:, None]).T @ x / len(y) + 1e-6 * np.eye(x.shape[1])
        step = np.linalg.solve(hessian, x.T @ (p - y) / len(y))
        w -= step
        if np.abs(step).max() < 1e-9:
            break
    score = x @ w
    covered, begin = 0, 0
    for step in steps:
        end = begin + len(step["outcomes"])
        top = np.argsort(-score[begin:end], kind="stable")[:budget]
        covered += bool(y[begin:end][top].any())
        begin = end
    return covered / len(steps)


def designs(tally: CoverageTally) -> str:
    """Next-draft prefetch against match-state prefetch: how often each was ready for the real
    outcome and how much critical-path time it hid per unit of the CPU it spent."""
    drafts, states = tally.design_hidden_per_spent
    steps = max(1, tally.steps)
    from_context = statistics.median(tally.from_context_ns) / 1000 if tally.from_context_ns else 0.0
    return (f"  designs: next draft from the old context {from_context:.1f} us; next-draft prefetch ready "
            f"{tally.prefetch_hits / steps:.3f}, {tally.spent_ns / steps / 1000:.1f} us/step, hides "
            f"{drafts or 0:.2f} us per us; match-state prefetch ready {tally.state_hits / steps:.3f}, "
            f"{tally.state_spent_ns / steps / 1000:.1f} us/step, hides {states or 0:.2f} us per us")


def report(path: str, budget: int, candidates: int) -> None:
    method = GapMethod(budget, candidates)
    replay(read_trace(path), method, 16, path)
    steps = method.steps
    n = max(1, len(steps))
    covered = sum(any((j, b) == s["real"] for _, j, b in s["outcomes"][:budget]) for s in steps)
    by_state = sum(s["real_state"] in set(s["states"][:budget]) for s in steps)
    print(f"{path}: {len(steps)} steps, budget {budget}")
    print(f"  coverage {covered / n:.3f} (ceiling {method.tally.ceiling:.3f}); by state {by_state / n:.3f}; "
          f"known j {method.tally.known_j_hits / max(1, method.tally.steps):.3f}; "
          f"re-ranked (in-sample bound) {logistic_bound(steps, budget):.3f}")
    print(designs(method.tally))
    print("  P(j) predicted / observed: " + ", ".join(
        f"j={j} {sum(s['p_j'][j] if j < len(s['p_j']) else 0.0 for s in steps) / n:.3f}/"
        f"{sum(s['j'] == j for s in steps) / n:.3f}" for j in range(6)))
    deciles: dict[int, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    for s in steps:
        true_j = s["j"]
        p_j = s["p_j"][true_j]
        for p, j, b in s["outcomes"]:
            if j == true_j and p_j > 0:
                cell = deciles[min(9, int(p / p_j * 10))]
                cell[0] += p / p_j
                cell[1] += (j, b) == s["real"]
                cell[2] += 1
    print("  P(b | j) at the true j, predicted / observed by decile: " + ", ".join(
        f"{d / 10:.1f}: {c[0] / c[2]:.2f}/{c[1] / c[2]:.2f}" for d, c in sorted(deciles.items()) if c[2] >= 20))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--budget", type=int, default=PrefetchConfig().budget)
    parser.add_argument("--candidates", type=int, default=64, help="outcomes the model lists per step")
    args = parser.parse_args()
    if args.budget < 1 or args.candidates < args.budget:
        raise SystemExit(f"need 1 <= --budget <= --candidates, got {args.budget} and {args.candidates}")
    for path in args.traces:
        report(path, args.budget, args.candidates)


if __name__ == "__main__":
    main()
