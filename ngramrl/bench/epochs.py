"""Tokens per forward epoch by epoch: how drafting evolves over a run (RL traces revisit their
prompts, and the policy sharpens from one epoch to the next).

The replay is the ordinary one (``replay``: each epoch replayed with what the earlier epochs left);
this only splits its forwards and committed tokens by the epoch of the rollout they belong to.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ngramrl.bench.methods import make_method
from ngramrl.bench.replay import replay
from ngramrl.config import DrafterConfig, HistoryConfig, PrefetchConfig
from ngramrl.core.trace import Rollout, Trace


@dataclass
class EpochSeries:
    method: str
    k: int
    tokens: dict[int, int] = field(default_factory=dict)
    forwards: dict[int, int] = field(default_factory=dict)

    def tokens_per_forward(self) -> dict[int, float]:
        return {epoch: self.tokens[epoch] / self.forwards[epoch] for epoch in sorted(self.forwards)
                if self.forwards[epoch]}

    def to_json(self) -> dict:
        return {"method": self.method, "k": self.k,
                "tokens_per_forward": {str(e): round(v, 4) for e, v in self.tokens_per_forward().items()},
                "tokens": {str(e): v for e, v in sorted(self.tokens.items())},
                "forwards": {str(e): v for e, v in sorted(self.forwards.items())}}


def replay_by_epoch(trace: Trace, method_name: str, k: int, drafter: DrafterConfig | None = None,
                    history: HistoryConfig | None = None) -> EpochSeries:
    """Replay ``trace`` through one method and count its forwards and tokens per epoch."""
    series = EpochSeries(method_name, k)
    method = make_method(method_name, drafter, history, PrefetchConfig(budget=0), [])

    def on_step(draft: list[int], accepted: int, rollout: Rollout, position: int) -> None:
        epoch = rollout.epoch
        series.forwards[epoch] = series.forwards.get(epoch, 0) + 1
        committed = min(accepted + 1, len(rollout.output) - position)
        series.tokens[epoch] = series.tokens.get(epoch, 0) + committed

    replay(trace, method, k, on_step=on_step)
    return series


def format_epochs(series: list[EpochSeries], baseline: str = "suffix") -> str:
    """One row per epoch: each method's tokens per forward, and ngramrl's ratio to the others."""
    if not series:
        return ""
    epochs = sorted({e for s in series for e in s.forwards})
    names = [s.method for s in series]
    head = f"{'epoch':>5} " + " ".join(f"{name:>9}" for name in names)
    by_name = {s.method: s.tokens_per_forward() for s in series}
    ratios = [name for name in names if name != "ngramrl" and "ngramrl" in by_name]
    head += "".join(f" {'x ' + name:>9}" for name in ratios)
    lines = [head]
    for epoch in epochs:
        row = f"{epoch:>5} " + " ".join(f"{by_name[name].get(epoch, float('nan')):>9.3f}" for name in names)
        for name in ratios:
            base = by_name[name].get(epoch)
            mine = by_name["ngramrl"].get(epoch)
            row += f" {(mine / base if base and mine else float('nan')):>8.2f}x"
        lines.append(row)
    return "\n".join(lines)
