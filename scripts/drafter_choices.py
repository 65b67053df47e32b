"""Tokens per forward of ngramrl's drafts under other drafter settings, side by side on the same
replayed steps: the evidence behind the choices in docs/drafter.md (path choice, levels, the
cross-prompt index, tree widths).

    python scripts/drafter_choices.py ngramrl/traces/*.jsonl.gz --k 16 --k 32 \\
        --variant path_width=2 --variant path_width=4 --variant levels=1 --variant use_global=false \\
        --variant tree:width=8

Each variant is a comma-separated list of DrafterConfig fields (``key=value``); a variant that
starts with ``tree:`` replays ``ngramrl-tree`` with ``width`` paths (other keys are DrafterConfig
fields). The baseline is the default chain and the default tree (width 4).
"""

from __future__ import annotations

import argparse
import json
import os

from ngramrl.bench.methods import NgramRLMethod, NgramRLTreeMethod
from ngramrl.bench.replay import replay
from ngramrl.bench.run import drafter_for
from ngramrl.config import DrafterConfig
from ngramrl.core.trace import read_trace


def parse_variant(text: str) -> tuple[str, int | None, dict]:
    """'tree:width=8,levels=2' -> ("tree", 8, {"levels": 2}); 'path_width=2' -> ("chain", None, {...})."""
    kind, _, rest = text.partition(":") if text.startswith("tree:") else ("chain", "", text)
    fields, width = {}, None
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"variant {text!r}: {item!r} is not key=value")
        parsed = {"true": True, "false": False}.get(value.lower(), value)
        if isinstance(parsed, str):
            parsed = float(value) if "." in value else int(value)
        if kind == "tree" and key == "width":
            width = int(parsed)
        elif key in DrafterConfig.__dataclass_fields__:
            fields[key] = parsed
        else:
            raise ValueError(f"variant {text!r}: unknown DrafterConfig field {key!r}")
    DrafterConfig(**fields)  # rejected here, before any replay
    return kind, width, fields


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--k", type=int, action="append", help="draft tokens (tree nodes) per step; repeatable")
    parser.add_argument("--variant", action="append", default=[])
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    variants = [("chain", None, {}), ("tree", 4, {})] + [parse_variant(v) for v in args.variant]
    rows: list[dict] = []
    for path in args.traces:
        trace = read_trace(path)
        for k in args.k or [16]:
            defaults: dict[str, float] = {}  # the default chain's and tree's tokens per forward (replayed first)
            for kind, width, fields in variants:
                drafter = drafter_for(trace, DrafterConfig(**fields))
                method = (NgramRLTreeMethod(drafter=drafter, width=width) if kind == "tree"
                          else NgramRLMethod(drafter=drafter))
                value = replay(trace, method, k).tokens_per_forward
                defaults.setdefault(kind, value)
                label = kind + (f" width={width}" if kind == "tree" else "") + "".join(
                    f" {key}={field}" for key, field in fields.items())
                rows.append({"trace": os.path.basename(path), "variant": label, "k": k,
                             "tokens_per_forward": round(value, 4), "vs_default": round(value / defaults[kind], 4)})
                print(f"{os.path.basename(path).split('.jsonl')[0]:<28} k={k:<3} {label:<34} {value:7.3f} "
                      f"{rows[-1]['vs_default']:6.3f}x of the default {kind}", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"rows": rows}, handle, indent=1)
            handle.write("\n")


if __name__ == "__main__":
    main()
