"""The vLLM proposer's time per engine step, replayed on a trace without vLLM.

    python scripts/proposer_step_time.py ngramrl/traces/gsm-smollm2-t0.6.jsonl.gz --batch 32 --regime cpu

The history holds the trace's earlier epochs; its last epoch is replayed through
``NgramRLProposer.propose`` with ``--batch`` requests in flight (a finished request is replaced by
the next; copies of the prompts where the epoch has fewer rollouts, as scripts/core_step_time.py
makes them): each step commits what the draft matched of the rollout plus the rollout's next token,
as verification would. Between two calls a pass over a buffer larger than the caches stands for
the forward, which leaves the proposer's data out of the caches as a real forward does. The
step-time model is fixed: ``cpu`` is the fit the engine learned on this 2-core machine at 8
requests in flight (drafting rarely pays at 32), ``gpu`` one where verifying is nearly free.
Prints the median and mean time of ``propose`` per step, the tokens it kept for verification and
the rows' steps, per repeat.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace

import numpy as np

from ngramrl.config import EngineConfig, NgramRLConfig
from ngramrl.core.cost import FixedStepCost
from ngramrl.engine.vllm_proposer import CONFIG_ENV, NgramRLProposer, config_to_env

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from core_step_time import workload  # noqa: E402 - the same requests (prompt copies) as the core's timing

REGIMES = {  # (base, per request, per verified token, per verifying step), seconds
    "cpu": (9.2e-05, 0.00294, 0.00225, 3.4e-05),
    "gpu": (0.02, 0.0002, 0.00001, 0.0),
}


class Runner:
    """The part of vLLM's model runner the proposer reads: the batch's request ids and requests."""

    def __init__(self) -> None:
        self.input_batch = SimpleNamespace(req_ids=[])
        self.requests: dict[str, SimpleNamespace] = {}

    def add(self, req_id: str, prompt_id: str, prompt: list[int], epoch: int) -> None:
        params = SimpleNamespace(extra_args={"prompt_id": prompt_id, "epoch": epoch})
        self.requests[req_id] = SimpleNamespace(sampling_params=params, prompt_token_ids=list(prompt),
                                                output_token_ids=[])
        self.input_batch.req_ids.append(req_id)

    def remove(self, req_id: str) -> None:
        del self.requests[req_id]
        self.input_batch.req_ids.remove(req_id)


def replay(trace_path: str, batch: int, k: int, regime: str, prefetch: str, flush: np.ndarray | None,
           threads: int = 1) -> dict:
    os.environ[CONFIG_ENV] = config_to_env(NgramRLConfig(engine=EngineConfig(prefetch=prefetch,
                                                                             draft_threads=threads)))
    vllm_config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        model_config=SimpleNamespace(max_model_len=1 << 20, hf_config=SimpleNamespace(eos_token_id=None)),
        device_config=SimpleNamespace(device_type="cpu"))
    proposer = NgramRLProposer(vllm_config)
    proposer.cost = FixedStepCost(*REGIMES[regime])
    runner = Runner()
    proposer.bind_runner(runner)
    history, waiting, _ = workload(trace_path, batch)  # with copies of the prompts to fill the batch
    for r in history:
        proposer.core.add_rollout(r.prompt_id, r.prompt, r.output, epoch=r.epoch)
    proposer.core.build_indexes()  # now, not in the timed steps
    live, position, drafts, times = {}, {}, {}, []
    kept = 0
    while waiting or live:
        while len(live) < batch and waiting:
            r = waiting.pop(0)
            req_id = f"{r.prompt_id}/{r.sample}"
            runner.add(req_id, r.prompt_id, r.prompt, r.epoch)
            live[req_id], position[req_id], drafts[req_id] = r, 0, []
        sampled, lengths = [], []
        for req_id in runner.input_batch.req_ids:
            r, i, draft = live[req_id], position[req_id], drafts[req_id]
            j = 0
            while j < len(draft) and i + j < len(r.output) and draft[j] == r.output[i + j]:
                j += 1
            committed = r.output[i:i + j + 1]
            position[req_id] = i + len(committed)
            sampled.append(committed)
            lengths.append(len(r.prompt) + position[req_id])
        if flush is not None:
            flush.sum()  # the forward
        begin = time.perf_counter_ns()
        out = proposer.propose(sampled, lengths, None)
        times.append(time.perf_counter_ns() - begin)
        kept += sum(len(d) for d in out)
        for req_id, draft in zip(list(runner.input_batch.req_ids), out, strict=True):
            drafts[req_id] = draft
            if position[req_id] >= len(live[req_id].output):
                runner.remove(req_id)
                del live[req_id]
    proposer.core.collect()
    return {"median_us": statistics.median(times) / 1000, "mean_us": statistics.fmean(times) / 1000,
            "steps": len(times), "kept_tokens": kept, "row_steps": proposer.stats.row_steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--regime", choices=sorted(REGIMES), default="cpu")
    parser.add_argument("--prefetch", choices=["off", "on"], default="off")
    parser.add_argument("--threads", type=int, default=1, help="EngineConfig.draft_threads")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-flush", action="store_true", help="no cache-flushing pass between steps")
    args = parser.parse_args()
    flush = None if args.no_flush else np.ones(8_000_000, dtype=np.float32)  # 32 MB
    for _ in range(args.repeats):
        result = replay(args.trace, args.batch, args.k, args.regime, args.prefetch, flush, args.threads)
        print(" ".join(f"{key} {value:.1f}" if isinstance(value, float) else f"{key} {value}"
                       for key, value in result.items()), flush=True)


if __name__ == "__main__":
    main()
