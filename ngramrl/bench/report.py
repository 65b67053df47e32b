"""Tables, JSON and plots for replay results."""

from __future__ import annotations

import json
import os

from ngramrl.bench.replay import ReplayResult


def print_now(line: str) -> None:
    """Print a progress line at once, also into a pipe."""
    print(line, flush=True)


def _by(results: list[ReplayResult], method: str, trace: str, k: int) -> ReplayResult | None:
    for r in results:
        if r.method == method and r.trace == trace and r.k == k:
            return r
    return None


def format_table(results: list[ReplayResult]) -> str:
    """One row per (trace, k, method) with ratios to SuffixDecoding and to the oracle ceiling."""
    header = f"{'workload':<16} {'trace':<34} {'k':>3} {'method':<13} {'tok/fwd':>8} {'x suffix':>8} {'x pld':>7} " \
             f"{'% oracle':>8} {'% p-orcl':>8} {'drafted':>7} {'accept':>6} {'coverage':>11} {'cpu us':>7} " \
             f"{'crit us':>7}"
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
        timed = not r.method.startswith("oracle")  # an oracle reads the future: its time means nothing
        cpu_us = f"{r.draft_us_per_step:.1f}" if timed and r.draft_us_per_step is not None else "-"
        critical_us = f"{r.critical_us_per_step:.1f}" if timed and r.critical_us_per_step is not None else "-"
        lines.append(
            f"{r.workload:<16} {os.path.basename(r.trace)[:34]:<34} {r.k:>3} {r.method:<13} "
            f"{r.tokens_per_forward:>8.3f} {vs_suffix:>8} {vs_pld:>7} {of_oracle:>8} {of_prompt_oracle:>8} "
            f"{f'{r.drafted_per_forward:.2f}' if timed else '-':>7} "
            f"{f'{r.acceptance:.2f}' if timed and r.acceptance is not None else '-':>6} "
            f"{coverage:>11} {cpu_us:>7} {critical_us:>7}"
        )
    for r in results:
        c = r.coverage
        if c and c.get("prefetch_us_per_step") is not None:
            line = (f"prefetch {os.path.basename(r.trace).split('.jsonl')[0]} k={r.k} B={c['budget']}: coverage "
                    f"{c['value']:.3f} of ceiling {c['ceiling']:.3f}"
                    + (f" ({100 * c['value'] / c['ceiling']:.0f}%)" if c["ceiling"] else "")
                    + f", next draft ready {c['ready']:.3f}; prefetch {c['prefetch_us_per_step']:.1f} us/step")
            if c.get("plan_us_per_row") is not None:
                line += (f" (planning {c['plan_us_per_row']:.1f} us, lookups {c['prefetch_lookup_us']:.1f} us each); "
                         f"a step's own lookup {c['step_lookup_us']:.1f} us")
            lines.append(line)
    lines.append("x suffix, x pld: tokens per forward over that method's. % oracle: over the ceiling's (best run "
                 "after a one-token match anywhere in the allowed history); % p-orcl: over the same, limited to the "
                 "same prompt's earlier rollouts. drafted: draft tokens verified per forward (what the gain costs "
                 "the target); accept: accepted / drafted.")
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
    colors = {"ngramrl": "#d62728", "ngramrl-tree": "#ff9896", "suffix": "#1f77b4", "pld": "#2ca02c",
              "none": "#7f7f7f", "oracle": "#bbbbbb",
              "oracle-prompt": "#e8e8e8"}
    top = 0.0
    for i, method in enumerate(methods):
        values = []
        for trace in traces:
            r = _by(results, method, trace, k)
            values.append(r.tokens_per_forward if r else 0.0)
        top = max(top, *values)
        xs = [t + (i - (len(methods) - 1) / 2) * width for t in range(len(traces))]
        ax.bar(xs, values, width, label=method, color=colors.get(method),
               hatch="//" if method.startswith("oracle") else None, edgecolor="black", linewidth=0.4)
    labels = [os.path.basename(trace).split(".jsonl")[0] for trace in traces]
    ax.set_xticks(range(len(traces)))
    ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("tokens per target forward")
    ax.set_title(f"Replay: tokens committed per forward (k={k}, warm history)")
    ax.set_ylim(0, top * 1.3)
    ax.legend(fontsize=8, ncol=3, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_sweep(results: list[ReplayResult]) -> str:
    """Coverage against prefetch budget, one row per trace, with the ceiling."""
    rows = [r for r in results if r.method == "ngramrl" and r.coverage and r.coverage.get("sweep")]
    if not rows:
        return ""
    budgets = list(rows[0].coverage["sweep"])
    header = f"{'coverage at budget B':<34} " + " ".join(f"{'B=' + b:>7}" for b in budgets) + f" {'ceiling':>8}"
    lines = [header, "-" * len(header)]
    for r in rows:
        values = " ".join(f"{r.coverage['sweep'][b]:>7.3f}" for b in budgets)
        lines.append(f"{os.path.basename(r.trace).split('.jsonl')[0][:34]:<34} {values} {r.coverage['ceiling']:>8.3f}")
    return "\n".join(lines)


def plot_coverage(results: list[ReplayResult], path: str) -> None:
    """Prefetch coverage against candidate budget per trace, ceilings dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if r.method == "ngramrl" and r.coverage and r.coverage.get("sweep")]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, r in enumerate(rows):
        budgets = [int(b) for b in r.coverage["sweep"]]
        color = f"C{i}"
        label = os.path.basename(r.trace).split(".jsonl")[0]
        ax.plot(budgets, list(r.coverage["sweep"].values()), marker="o", color=color, label=label)
        ax.axhline(r.coverage["ceiling"], color=color, linestyle="--", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prefetch budget B (next-draft lookups per request per step)")
    ax.set_ylabel("coverage (next draft ready)")
    ax.set_ylim(0, 1)
    ax.set_title("Prefetch coverage vs budget (dashed: ceiling)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
