"""The run report: one PNG in the run directory (and in wandb) that shows what the run did.

- reward per step (mean and spread of the step's rollouts);
- tokens per target forward per step: what vLLM verified and committed, and what the drafts
  offered (what verifying them whole would have given; the step-cost model verifies less where
  verifying costs more than it saves, as on a CPU);
- rollout time per step;
- the run's own trace replayed through ngramrl, SuffixDecoding and prompt lookup, epoch by epoch
  (each epoch with only what the earlier ones left): the drafter's advantage on this very run.

``report.json`` beside it holds the same numbers.
"""

from __future__ import annotations

import json
import logging
import math
import os
import zlib
from typing import Any

from ngramrl.bench.epochs import EpochSeries, format_epochs, replay_by_epoch
from ngramrl.bench.run import drafter_for
from ngramrl.config import DrafterConfig, HistoryConfig
from ngramrl.core.trace import Rollout, Trace, iter_trace
from ngramrl.pipeline.rundir import REPORT_JSON, REPORT_PNG

logger = logging.getLogger(__name__)

REPLAYED = ("ngramrl", "suffix", "pld")
# The replay runs at the run's end in its driver (tens of thousands of tokens a second per method):
# a long GPU run's trace (hundreds of millions of tokens) is replayed for a sample of its prompts,
# all of each one's epochs, so the report takes a minute or two, not hours.
REPLAY_TOKENS = 1_000_000


def replayed_trace(trace_path: str, max_tokens: int = REPLAY_TOKENS) -> tuple[Trace, int, int]:
    """The run's trace, or where its outputs exceed ``max_tokens`` the rollouts of the prompts that
    fit, chosen by a stable hash of their ids (so every epoch of a chosen prompt is in); read as it
    streams (the whole trace never sits in memory). Also the prompts kept and all the prompts."""
    tokens: dict[str, int] = {}
    total = 0
    items = iter(iter_trace(trace_path))
    header = next(items)
    held: list[Rollout] = []  # the rollouts as long as they fit: a trace that fits is read once
    for item in items:
        if isinstance(item, Rollout):
            tokens[item.prompt_id] = tokens.get(item.prompt_id, 0) + len(item.output)
            total += len(item.output)
            if total <= max_tokens:
                held.append(item)
    if total <= max_tokens:
        return Trace(header, held, trace_path), len(tokens), len(tokens)
    kept, fitting = set(), 0
    for prompt_id in sorted(tokens, key=lambda p: (zlib.crc32(p.encode("utf-8")), p)):
        if kept and fitting + tokens[prompt_id] > max_tokens:
            continue
        kept.add(prompt_id)
        fitting += tokens[prompt_id]
    rollouts = [item for item in iter_trace(trace_path) if isinstance(item, Rollout) and item.prompt_id in kept]
    return Trace(header, rollouts, trace_path), len(kept), len(tokens)


def replay_run(trace_path: str, k: int, history: HistoryConfig,
               max_tokens: int = REPLAY_TOKENS) -> tuple[list[EpochSeries], int, int]:
    """The run's trace through each drafter, epoch by epoch (a method whose package is missing is
    left out); with the prompts replayed and the run's prompts (fewer where the trace is long)."""
    trace, replayed, prompts = replayed_trace(trace_path, max_tokens)
    if not any(r.epoch >= 1 for r in trace.rollouts):
        return [], replayed, prompts
    series = []
    for name in REPLAYED:
        try:
            series.append(replay_by_epoch(trace, name, k, drafter_for(trace, DrafterConfig()), history))
        except RuntimeError as err:  # e.g. SuffixDecoding's package is not installed
            logger.warning("report: %s left out of the replay (%s)", name, err)
    return series, replayed, prompts


def write_report(output_dir: str, steps: list[dict[str, Any]], trace_path: str, k: int,
                 history: HistoryConfig) -> tuple[str, dict[str, Any]]:
    """Write report.png and report.json into ``output_dir``; returns the PNG's path and the summary."""
    series, replayed, prompts = replay_run(trace_path, k, history)
    summary: dict[str, Any] = {"steps": steps, "replay_k": k, "replay": [s.to_json() for s in series],
                               "replay_prompts": replayed, "run_prompts": prompts}
    overall = {s.method: sum(s.tokens.values()) / max(1, sum(s.forwards.values())) for s in series}
    summary["replay_tokens_per_forward"] = {name: round(value, 4) for name, value in overall.items()}
    for name in ("suffix", "pld"):
        if "ngramrl" in overall and overall.get(name):
            summary[f"replay_ngramrl_over_{name}"] = round(overall["ngramrl"] / overall[name], 4)
    with open(os.path.join(output_dir, REPORT_JSON), "w") as handle:
        json.dump(summary, handle, indent=1)
    path = os.path.join(output_dir, REPORT_PNG)
    _plot(path, steps, series, k, "" if replayed == prompts else f", {replayed} of {prompts} prompts")
    table = format_epochs(series)
    if table:
        logger.info("replay of this run's trace, tokens per forward by epoch (k=%d):\n%s", k, table)
    return path, summary


def _plot(path: str, steps: list[dict[str, Any]], series: list[EpochSeries], k: int, sampled: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    x = [s["step"] for s in steps]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    ax = axes[0][0]
    reward = [s["reward"] for s in steps]
    spread = [s.get("reward_std", 0.0) for s in steps]
    ax.plot(x, reward, marker="o", color="tab:green")
    ax.fill_between(x, [r - d for r, d in zip(reward, spread, strict=True)],
                    [r + d for r, d in zip(reward, spread, strict=True)], color="tab:green", alpha=0.15)
    ax.set(title="reward (mean, +-1 std over the step's rollouts)", xlabel="training step", ylabel="reward")
    ax = axes[0][1]
    def measured(key: str) -> list[float]:  # a step that measured nothing: a gap in the line
        return [math.nan if s.get(key) is None else s[key] for s in steps]

    offered = measured("offered_tokens_per_forward")
    if not all(math.isnan(value) for value in offered):  # only ngramrl's drafts say what they offered
        ax.plot(x, offered, marker="o", label="offered by the drafts")
    ax.plot(x, measured("tokens_per_forward"), marker="s", label="verified (vLLM)")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set(title="tokens per target forward", xlabel="training step", ylabel="tokens / forward")
    ax.legend(fontsize=8)
    ax = axes[1][0]
    ax.bar(x, [s["rollout_seconds"] for s in steps], color="tab:blue", alpha=0.7)
    ax.set(title="rollout time per step", xlabel="training step", ylabel="seconds")
    ax = axes[1][1]
    for s in series:
        tpf = s.tokens_per_forward()
        ax.plot(list(tpf), list(tpf.values()), marker="o", label=s.method)
    ax.set(title=f"this run's trace replayed (k={k}{sampled}): tokens per forward",
           xlabel="epoch (visit of the prompts)",
           ylabel="tokens / forward")
    if series:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "one epoch only: nothing to replay", ha="center", va="center", transform=ax.transAxes)
    for row in axes:
        for ax in row:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(f"ngramrl run report ({len(steps)} steps)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
