"""Tokens per forward of ngramrl's drafts under other drafter settings, side by side on the same
replayed steps: the evidence behind the choices in docs/drafter.md (path choice, levels, the
cross-prompt index, tree widths).

    python scripts/drafter_choices.py ngramrl/traces/*.jsonl.gz --k 16 --k 32 \\
        --variant path_width=2 --variant path_width=4 --variant levels=1 --variant use_global=false \\
        --variant tree:width=8

Each variant is a comma-separated list of DrafterConfig fields (``key=value``); a variant that
starts with ``tree:`` replays ``ngramrl-tree`` with ``width`` paths (other keys are DrafterConfig
fields), ``tree-estimates:`` the same tree grown on the raw estimates instead of the acceptance
chances calibrated on the trees verified before; ``longest-match:`` (fields may follow) replays
the rule the continuation estimate replaced, as the comparison's baseline: follow the most
frequent continuation of the longest suffix that has one, from the cross-prompt index instead
when it matches a longer suffix (``LongestMatchDrafter``); ``calibrated-path:width=W`` replays the
chain chosen as the root path of largest expected accepted length in the tree of W paths grown on
the acceptance chances calibrated on the chains verified before (``path_width`` chooses it on the raw
estimates). The baseline is the default chain and the default tree (width 4).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

from ngramrl.bench.methods import NgramRLTreeMethod, ReferenceMethod
from ngramrl.bench.replay import replay
from ngramrl.bench.run import drafter_for
from ngramrl.config import DrafterConfig
from ngramrl.core.drafter import Draft, NgramDrafter
from ngramrl.core.estimate import Source
from ngramrl.core.history import RolloutHistory
from ngramrl.core.trace import read_trace
from ngramrl.core.tree import path_chain


class LongestMatchDrafter(NgramDrafter):
    """The chain of the longest-match rule: the most frequent continuation of the longest matched
    suffix that has one (Witten-Bell estimates of that state alone, backing off where occurrences
    end), from the index whose match is longer, the prompt's on ties."""

    def chain(self, sources: list[Source], k: int) -> Draft:
        best = self._walk(sources[0], k, "prompt")
        if len(sources) > 1 and sources[1][1].matched > best.matched:
            other = self._walk(sources[1], k, "global")
            if other.tokens:
                best = other
        return best

    def _walk(self, source: Source, k: int, name: str) -> Draft:
        index, match = source
        link, length, count, nxt = index.link, index.length, index.count, index.next
        best_token, best_state, followed = index.best_token, index.best_state, index.followed
        min_match = self.config.min_match
        state, matched = match.state, min(match.matched, length[match.state])
        while best_token[state] < 0 and length[state] > min_match:
            state = link[state]
            matched = length[state]
        if best_token[state] < 0 or matched < min_match:
            return Draft([], matched=matched)
        tokens: list[int] = []
        probs: list[float] = []
        survive = 1.0
        while True:
            token, child = best_token[state], best_state[state]
            children = nxt[state]
            p = count[child] / (followed[state] + (1 if children is None else len(children)))
            survive *= p
            if survive < self.config.min_confidence:
                break
            tokens.append(token)
            probs.append(p)
            if len(tokens) >= k or token in self.config.stop_tokens:
                break
            state = child
            while best_token[state] < 0 and length[link[state]] >= min_match:
                state = link[state]
            if best_token[state] < 0:
                break
        return Draft(tokens, probs, matched, name)


class CalibratedPathDrafter(NgramDrafter):
    """The chain of ``calibrated-path:``: ``NgramDrafter.chain``'s choice for ``path_width`` W > 1
    (``path_chain``) made in a tree grown on the acceptance chances ``chance`` instead of the raw
    estimates."""

    def __init__(self, history: RolloutHistory, config: DrafterConfig, width: int,
                 chance: Callable[[int, float], float]) -> None:
        super().__init__(history, config)
        self.width = width
        self.chance = chance

    def chain(self, sources: list[Source], k: int) -> Draft:
        config = self.config
        tokens, probs = path_chain(sources, k, self.width, config.levels, config.min_match, config.min_confidence,
                                   config.stop_tokens, self.chance)
        if not tokens:
            return Draft([], matched=sources[0][1].matched)
        return Draft(tokens, probs, sources[0][1].matched, self._source_of(sources, tokens[0]))


def parse_variant(text: str) -> tuple[str, int | None, dict]:
    """'tree:width=8,levels=2' -> ("tree", 8, {"levels": 2}); 'path_width=2' -> ("chain", None, {...});
    'longest-match:' -> ("longest-match", None, {}); 'tree-estimates:width=4' -> ("tree-estimates", 4, {})."""
    if text.startswith(("tree:", "tree-estimates:", "longest-match:", "calibrated-path:")):
        kind, _, rest = text.partition(":")
    else:
        kind, rest = "chain", text
    fields, width = {}, None
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"variant {text!r}: {item!r} is not key=value")
        parsed = {"true": True, "false": False}.get(value.lower(), value)
        if isinstance(parsed, str):
            parsed = float(value) if "." in value else int(value)
        if kind.startswith(("tree", "calibrated-path")) and key == "width":
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
                method = (NgramRLTreeMethod(drafter=drafter, width=width, calibrated=kind == "tree")
                          if kind.startswith("tree") else ReferenceMethod(drafter=drafter))
                if kind == "longest-match":
                    method.drafter = LongestMatchDrafter(method.history, drafter)
                if kind == "calibrated-path":  # the chances its verified chains calibrate
                    method.drafter = CalibratedPathDrafter(method.history, drafter, width or 4,
                                                           method.calibration.chance)
                value = replay(trace, method, k).tokens_per_forward
                baseline = "tree" if kind.startswith("tree") else "chain"
                defaults.setdefault(baseline, value)
                label = kind + (f" width={width}" if width is not None else "") + "".join(
                    f" {key}={field}" for key, field in fields.items())
                rows.append({"trace": os.path.basename(path), "variant": label, "k": k,
                             "tokens_per_forward": round(value, 4),
                             "vs_default": round(value / defaults[baseline], 4)})
                print(f"{os.path.basename(path).split('.jsonl')[0]:<28} k={k:<3} {label:<34} {value:7.3f} "
                      f"{rows[-1]['vs_default']:6.3f}x of the default {baseline}", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"rows": rows}, handle, indent=1)
            handle.write("\n")


if __name__ == "__main__":
    main()
