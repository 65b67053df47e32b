"""SuffixDecoding under other settings than vLLM's defaults, beside ngramrl, on the same replayed
steps: how much of ngramrl's lead over the ``suffix`` baseline of ``ngramrl bench`` (vLLM's
defaults: tree depth 24, ``max_spec_factor`` 1.0, ``min_token_prob`` 0.1) is SuffixDecoding's
length limit, which keeps its drafts short (at most as long as the matched suffix, times the
factor) and so verifies fewer tokens per forward. Replay counts verified tokens as free; the
drafted and acceptance columns say what each setting costs the target.

    python scripts/suffix_settings.py ngramrl/traces/*.jsonl.gz --k 16 \\
        --setting 24,1.0,0.1 --setting 64,1.0,0.1 --setting 64,4.0,0.1 --setting 64,4.0,0.0
"""

from __future__ import annotations

import argparse
import json
import os

from ngramrl.bench.methods import SuffixMethod, make_method
from ngramrl.bench.replay import replay
from ngramrl.bench.run import drafter_for
from ngramrl.config import DrafterConfig
from ngramrl.core.trace import read_trace


def setting(text: str) -> tuple[int, float, float]:
    depth, factor, probability = text.split(",")
    return int(depth), float(factor), float(probability)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--setting", type=setting, action="append", required=True,
                        metavar="DEPTH,FACTOR,MIN_PROB", help="max_tree_depth, max_spec_factor, min_token_prob")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = []
    for path in args.traces:
        trace = read_trace(path)
        runs = {"ngramrl": replay(trace, make_method("ngramrl", drafter_for(trace, DrafterConfig())), args.k)}
        for depth, factor, probability in args.setting:
            name = f"suffix depth={depth} factor={factor:g} min_prob={probability:g}"
            runs[name] = replay(trace, SuffixMethod(depth, factor, probability), args.k)
        ours = runs["ngramrl"].tokens_per_forward
        for name, result in runs.items():
            row = {"trace": os.path.basename(path), "method": name, "k": args.k,
                   "tokens_per_forward": round(result.tokens_per_forward, 4),
                   "drafted_per_forward": round(result.drafted_per_forward, 3),
                   "acceptance": None if result.acceptance is None else round(result.acceptance, 3),
                   "ngramrl_over": round(ours / result.tokens_per_forward, 4)}
            rows.append(row)
            print(f"{row['trace']:<34} {name:<42} tok/fwd {row['tokens_per_forward']:.3f}  drafted "
                  f"{row['drafted_per_forward']:.2f}  accept {row['acceptance'] or 0:.2f}  ngramrl x "
                  f"{row['ngramrl_over']:.2f}", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"command": "python scripts/suffix_settings.py", "k": args.k, "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
