"""The drafting core's time per engine step at B requests in flight, against SuffixDecoding's, replayed on a trace.

    python scripts/core_step_time.py ngramrl/traces/gsm-smollm2-t0.6.jsonl.gz --batch 256 1024 --threads 2 \\
        --json docs/results/native_steps.json

The history holds the trace's earlier epochs; its last epoch is replayed with B requests in flight
(copies of its prompts make at least 2B requests, so the batch stays full for a while: copy c
shifts every token but the end-of-sequence ones by c times the vocabulary, so copies never draft
from each other, and each copy gets the same history). Each step commits, per row, what its draft matched of the
rollout plus the rollout's next token (what exact verification commits), then a pass over a 32 MB
buffer stands for the forward and leaves the drafter's data out of the caches, as a real forward
does. Every row drafts at every step (k tokens): the cost model never switches drafting off.

Methods, each through the same loop:
- ``core``: ``step`` for all rows, then ``absorb`` and ``prefetch`` (both run in the background
  during the forward stand-in on the native core); the requests that ended ``finish`` with their
  epoch between the two, as in the engine's proposer (their history work then runs in the
  background too, before the prefetch, whose drafts stay valid).
  The critical path is every core call made between two forwards (``stop`` waits there for
  background work that did not finish during the forward);
- ``core-sync``: the same without prefetch (``absorb`` still in the background);
- ``suffix``: SuffixDecoding's C++ cache as vLLM's ``suffix`` method drives it
  (``add_active_response`` then ``speculate`` per row, ``start_request``/``stop_request``).

Prints, per method and B: the critical path per step (median, mean, p99) and per request-step over
the steps with B requests in flight (as bench-steps counts them), the background work per step,
the outcome model and allocation per request-step, and tokens per forward (which must be the same
for ``core`` and ``core-sync``: a prefetched draft is the synchronous one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from ngramrl.bench.replay import accepted_prefix
from ngramrl.config import DrafterConfig, HistoryConfig, PrefetchConfig
from ngramrl.core.batch import make_core
from ngramrl.core.trace import Rollout, read_trace


def workload(path: str, batch: int) -> tuple[list[Rollout], list[Rollout], tuple[int, ...]]:
    trace = read_trace(path)
    last = max(r.epoch for r in trace.rollouts)
    keep = frozenset(trace.header.eos_token_ids)
    vocab = max(trace.header.vocab_size, 1 + max(max(r.prompt + r.output, default=0) for r in trace.rollouts))
    replayed = [r for r in trace.rollouts if r.epoch == last]
    copies = max(1, -(-2 * batch // len(replayed)))  # twice B: the batch stays full for a while

    def copy(r: Rollout, c: int) -> Rollout:
        shift = c * vocab
        move = (lambda ts: list(ts)) if c == 0 else (lambda ts: [t if t in keep else t + shift for t in ts])
        return Rollout(r.prompt_id if c == 0 else f"{r.prompt_id}~{c}", r.epoch, r.sample, move(r.prompt),
                       move(r.output), r.finish_reason)

    history = [copy(r, c) for c in range(copies) for r in trace.rollouts if r.epoch < last]
    return history, [copy(r, c) for c in range(copies) for r in replayed], tuple(trace.header.eos_token_ids)


def _verify(entry: list) -> list[int]:
    """One forward of a live row ``[rollout, position, draft]``: what its draft matched of the
    rollout plus the token after it, the position moved past them."""
    rollout, position, draft = entry
    piece = rollout.output[position:position + accepted_prefix(draft, rollout.output[position:]) + 1]
    entry[1] = position + len(piece)
    return piece


def run_core(path: str, batch: int, k: int, threads: int, prefetch: bool, native: bool, flush: np.ndarray,
             budget: int) -> dict:
    history, requests, stops = workload(path, batch)
    core = make_core(HistoryConfig(), DrafterConfig(max_draft=k, stop_tokens=stops), PrefetchConfig(budget=budget),
                     threads=threads, native=native)
    for r in history:
        core.add_rollout(r.prompt_id, r.prompt, r.output, r.epoch)
    core.build_indexes()
    waiting = list(requests)
    live: dict[int, list] = {}   # handle -> [rollout, position, draft]
    step_ns: list[int] = []
    in_flight: list[int] = []
    tokens = forwards = 0
    clock = time.perf_counter_ns
    before = core.timings() if native else None
    while waiting or live:
        # The forward: verification against the trace, then the stand-in for its memory traffic.
        handles, committed, done = [], [], []
        for h, entry in live.items():
            piece = _verify(entry)
            tokens += len(piece)
            forwards += 1
            if entry[1] >= len(entry[0].output):
                done.append(h)
            else:
                handles.append(h)
                committed.append(piece)
        flush.sum()
        offsets = np.zeros(len(handles) + 1, dtype=np.int64)
        np.cumsum([len(c) for c in committed], out=offsets[1:])
        flat = np.fromiter((t for c in committed for t in c), dtype=np.int32, count=int(offsets[-1]))
        ks = np.full(len(handles), k, dtype=np.int32)
        in_flight.append(len(live))
        # The proposer's call: everything from here to the next forward is on the critical path.
        begin = clock()
        core.stop(cancel=True)
        joined = []
        while len(live) - len(done) + len(joined) < batch and waiting:
            r = waiting.pop(0)
            joined.append((core.start(r.prompt_id, r.prompt, [], register=True), r))
        drafts = core.step(handles, flat, offsets, ks) if handles else None
        for h in done:  # after the step's drafts and before the prefetch, as the engine's proposer does
            core.finish(h, live.pop(h)[0].epoch)
        if prefetch and drafts is not None:
            core.prefetch(handles, drafts.tokens, drafts.offsets, drafts.probs, k, absorb=handles)
        else:
            core.absorb(handles)
        step_ns.append(clock() - begin)
        for i, h in enumerate(handles):
            live[h][2] = drafts.tokens[drafts.offsets[i]:drafts.offsets[i + 1]].tolist()
        for h, r in joined:  # a new request's first token comes from its prefill: no draft yet
            live[h] = [r, 0, []]
    core.collect()
    out = {"tokens_per_forward": tokens / forwards, **_times(step_ns, in_flight, batch)}
    if native:
        after = core.timings()
        spent = {key: after[key] - before[key] for key in after}
        background = spent["absorb_ns"] + spent["plan_ns"] + spent["prefetch_lookup_ns"]
        out["offpath_us_mean"] = background / 1e3 / len(step_ns)
        out["plan_us_per_request"] = spent["plan_ns"] / 1e3 / max(1, spent["plan_rows"])
        out["prefetch_lookups_per_step"] = spent["prefetch_lookups"] / len(step_ns)
        out["memory_bytes"] = core.memory_bytes()
        out["stored_tokens"] = core.stored_tokens
    core.close()
    return out


def run_suffix(path: str, batch: int, k: int, flush: np.ndarray) -> dict:
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    history, requests, _ = workload(path, batch)
    depth = 24
    cache = SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=-1)
    for n, r in enumerate(history):
        cache.start_request(f"h{n}", r.prompt)
        if r.output:
            cache.add_active_response(f"h{n}", r.output)
        cache.stop_request(f"h{n}")
    waiting = list(enumerate(requests))
    live: dict[str, list] = {}
    step_ns: list[int] = []
    in_flight: list[int] = []
    tokens = forwards = 0
    clock = time.perf_counter_ns
    while waiting or live:
        rows, done = [], []
        for rid, entry in live.items():
            piece = _verify(entry)
            tokens += len(piece)
            forwards += 1
            (done if entry[1] >= len(entry[0].output) else rows).append((rid, piece))
        flush.sum()
        in_flight.append(len(live))
        begin = clock()
        for rid, _ in done:
            cache.stop_request(rid)
            del live[rid]
        joined = []
        while len(live) + len(joined) < batch and waiting:
            n, r = waiting.pop(0)
            cache.start_request(f"r{n}", r.prompt)
            joined.append((f"r{n}", r))
        for rid, piece in rows:
            r, i, _ = live[rid]
            cache.add_active_response(rid, piece)
            context = (r.prompt + r.output[:i])[-depth:]
            live[rid][2] = list(cache.speculate(rid, context, max_spec_tokens=k, max_spec_factor=1.0,
                                                min_token_prob=0.1).token_ids)
        step_ns.append(clock() - begin)
        for rid, r in joined:
            live[rid] = [r, 0, []]
    return {"tokens_per_forward": tokens / forwards, **_times(step_ns, in_flight, batch)}


def replay_tokens_per_forward(path: str, k: int, native: bool) -> float:
    """``ngramrl bench``'s replay (one rollout at a time, epochs >= 1 drafting from the earlier
    epochs, a replayed rollout dropped when it ends) through the core: its tokens per forward
    must be the bench's ngramrl figure."""
    trace = read_trace(path)
    core = make_core(HistoryConfig(), DrafterConfig(stop_tokens=tuple(sorted(trace.header.eos_token_ids))),
                     PrefetchConfig(), native=native)
    tokens = forwards = 0
    for epoch in sorted({r.epoch for r in trace.rollouts}):
        rollouts = [r for r in trace.rollouts if r.epoch == epoch]
        if epoch >= 1:
            for r in rollouts:
                h = core.start(r.prompt_id, r.prompt)
                position, committed = 0, []
                while position < len(r.output):
                    drafts = core.step([h], committed, [0, len(committed)], [k])
                    draft = drafts.tokens.tolist()
                    core.absorb([h])
                    accepted = accepted_prefix(draft[:k], r.output[position:])
                    committed = r.output[position:position + accepted + 1]
                    position += len(committed)
                    forwards += 1
                tokens += len(r.output)
                core.step([h], committed, [0, len(committed)], [0])  # the last commit, then the end
                core.finish(h)
        for r in rollouts:
            core.add_rollout(r.prompt_id, r.prompt, r.output, r.epoch)
    return tokens / forwards


def _times(step_ns: list[int], in_flight: list[int], batch: int) -> dict:
    """The critical path over the steps with ``batch`` requests in flight (as bench-steps counts
    them: the ramp up and the drain at the end are other batch sizes)."""
    full = [ns for ns, rows in zip(step_ns, in_flight, strict=True) if rows == batch]
    if not full:
        raise ValueError(f"no step had {batch} requests in flight")
    ordered = sorted(full)
    return {"steps": len(full), "step_us_median": statistics.median(full) / 1e3,
            "step_us_mean": statistics.fmean(full) / 1e3,
            "step_us_p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] / 1e3,
            "request_us_mean": sum(full) / 1e3 / (batch * len(full))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--batch", type=int, nargs="+", default=[256])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--budget", type=int, default=16, help="prefetch lookups per request per step")
    parser.add_argument("--method", nargs="+", default=["core", "core-sync", "suffix"],
                        choices=["core", "core-sync", "reference", "suffix"])
    parser.add_argument("--json", help="write the runs here")
    parser.add_argument("--replay-k", type=int, nargs="*", default=[],
                        help="also replay each trace as ngramrl bench does at these k (tokens per forward)")
    args = parser.parse_args()
    flush = np.ones(8_000_000, dtype=np.float32)  # 32 MB
    runs = []
    for path in args.traces:
        for batch in args.batch:
            for method in args.method:
                if method == "suffix":
                    result = run_suffix(path, batch, args.k, flush)
                else:
                    result = run_core(path, batch, args.k, args.threads, method == "core", method != "reference",
                                      flush, args.budget)
                run = {"trace": path, "method": method, "batch": batch,
                       "threads": 1 if method == "suffix" else args.threads, **result}
                runs.append(run)
                print(" ".join(f"{key} {value:.2f}" if isinstance(value, float) else f"{key} {value}"
                               for key, value in run.items()), flush=True)
    replays = []
    for path in args.traces:
        for k in args.replay_k:
            tpf = round(replay_tokens_per_forward(path, k, True), 4)
            replays.append({"trace": path, "k": k, "tokens_per_forward": tpf})
            print(f"replay {path} k {k} tokens_per_forward {replays[-1]['tokens_per_forward']}", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"core_step_time": 1, "k": args.k, "budget": args.budget, "runs": runs, "replay": replays},
                      handle, indent=1)


if __name__ == "__main__":
    main()
