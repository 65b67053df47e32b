"""Tables, JSON and plots for replay results."""

from __future__ import annotations

import json
import os

from ngramrl.bench.replay import ReplayResult


def _by(results: list[ReplayResult], method: str, trace: str, k: int) -> ReplayResult | None:
    for r in results:
        if r.method == method and r.trace == trace and r.k == k:
            return r
    return None


def format_table(results: list[ReplayResult]) -> str:
    """One row per (trace, k, method) with ratios to SuffixDecoding and to the oracle ceiling."""
    header = f"{'workload':<16} {'trace':<34} {'k':>3} {'method':<13} {'tok/fwd':>8} {'x suffix':>8} {'x pld':>7} " \
             f"{'% oracle':>8} {'% p-orcl':>8} {'coverage':>11} {'draft us':>9}"
    lines = [header, "-" * len(header)]
    for r in results:
        suffix = _by(results, "suffix", r.trace, r.k)
        pld = _by(results, "pld", r.trace, r.k)
        oracle = _by(results, "oracle", r.trace, r.k)
        prompt_oracle = _by(results, "oracle-prompt", r.trace, r.k)
        vs_suffix = f"{r.tokens_per_forward / suffix.tokens_per_forward:.2f}" if suffix and suffix.forwards else "-"
        vs_pld = f"{r.tokens_per_forward / pld.tokens_per_forward:.2f}" if pld and pld.forwards else "-"
        of_oracle = (f"{100 * r.tokens_per_forward / oracle.tokens_per_forward:.0f}%"
                     if oracle and oracle.forwards and r.method != "oracle" else "-")
        of_prompt_oracle = (f"{100 * r.tokens_per_forward / prompt_oracle.tokens_per_forward:.0f}%"
                            if prompt_oracle and prompt_oracle.forwards and r.method != "oracle-prompt" else "-")
        coverage = (f"{r.coverage['value']:.3f}/{r.coverage['ceiling']:.3f}" if r.coverage else "-")
        draft_us = (f"{r.draft_us_per_step:.1f}" if r.draft_us_per_step is not None
                    and not r.method.startswith("oracle") else "-")
        lines.append(
            f"{r.workload:<16} {os.path.basename(r.trace)[:34]:<34} {r.k:>3} {r.method:<13} "
            f"{r.tokens_per_forward:>8.3f} {vs_suffix:>8} {vs_pld:>7} {of_oracle:>8} {of_prompt_oracle:>8} "
            f"{coverage:>11} {draft_us:>9}"
        )
    lines.append("x suffix, x pld: tokens per forward over that method's. % oracle: over the ceiling's (best run "
                 "after a one-token match anywhere in the allowed history); % p-orcl: over the same, limited to the "
                 "same prompt's earlier rollouts.")
    return "\n".join(lines)


def to_json(results: list[ReplayResult], extra: dict | None = None) -> dict:
    out = {"ngramrl_bench": 1, "runs": [r.to_json() for r in results]}
    if extra:
        out.update(extra)
    return out


def write_json(path: str, results: list[ReplayResult], extra: dict | None = None) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(to_json(results, extra), handle, indent=1)
        handle.write("\n")


def plot_tokens_per_forward(results: list[ReplayResult], path: str, k: int) -> None:
    """Grouped bars: tokens per forward by method, one group per trace, at draft length k."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(r.trace for r in results if r.k == k))
    methods = list(dict.fromkeys(r.method for r in results if r.k == k))
    width = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(traces) + 2), 4.2))
    colors = {"ngramrl": "#d62728", "suffix": "#1f77b4", "pld": "#2ca02c", "none": "#7f7f7f", "oracle": "#bbbbbb"}
    for i, method in enumerate(methods):
        values = []
        for trace in traces:
            r = _by(results, method, trace, k)
            values.append(r.tokens_per_forward if r else 0.0)
        xs = [t + (i - (len(methods) - 1) / 2) * width for t in range(len(traces))]
        ax.bar(xs, values, width, label=method, color=colors.get(method),
               hatch="//" if method == "oracle" else None, edgecolor="black", linewidth=0.4)
    labels = [os.path.basename(trace).split(".jsonl")[0] for trace in traces]
    ax.set_xticks(range(len(traces)))
    ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("tokens per target forward")
    ax.set_title(f"Replay: tokens committed per forward (k={k}, warm history)")
    ax.legend(fontsize=8, ncol=len(methods))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
