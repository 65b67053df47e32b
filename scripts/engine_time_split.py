"""Where an in-process vLLM engine's generate time goes, for one arm of the engine benchmark.

    python scripts/engine_time_split.py none      # no speculation
    python scripts/engine_time_split.py floor     # speculative mode, a proposer that never drafts
    python scripts/engine_time_split.py ngramrl   # ngramrl (prefetch: auto)
    python scripts/engine_time_split.py sync      # ngramrl drafting synchronously

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with 32 requests in flight:
two warm-up epochs of 4 GSM prompts x 8 samples (SmolLM2-135M-Instruct, temperature 0.6, 160
tokens), then four timed epochs. Prints one JSON line: tokens, seconds, tokens per second, and the
milliseconds spent in the model runner's ``execute_model`` (the forward) and ``sample_tokens``
(sampling, and the proposer), vLLM's samplers, the scheduler, and each garbage-collector
generation, with call counts. Run the arms one after another, not at once.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # everything in this process, where it can be timed
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")

ARMS = ("none", "floor", "ngramrl", "sync")
spent: dict[str, int] = {}


def time_calls(owner: Any, name: str, key: str) -> None:
    original = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        begin = time.perf_counter_ns()
        try:
            return original(*args, **kwargs)
        finally:
            spent[key] = spent.get(key, 0) + time.perf_counter_ns() - begin
            spent[key + "_calls"] = spent.get(key + "_calls", 0) + 1

    setattr(owner, name, timed)


def time_collections() -> None:
    started = [0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter_ns()
            return
        key = f"gc{info['generation']}"
        spent[key] = spent.get(key, 0) + time.perf_counter_ns() - started[0]
        spent[key + "_calls"] = spent.get(key + "_calls", 0) + 1

    gc.callbacks.append(callback)


def main(arm: str) -> None:
    if arm not in ARMS:
        raise SystemExit(f"engine_time_split.py: arm must be one of {', '.join(ARMS)}, got {arm!r}")
    from ngramrl.engine import vllm_plugin

    vllm_plugin.register()
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    for owner, name, key in ((GPUModelRunner, "execute_model", "execute_model"),
                             (GPUModelRunner, "sample_tokens", "sample_tokens"),
                             (Sampler, "forward", "sampler"), (RejectionSampler, "forward", "rejection_sampler"),
                             (Scheduler, "schedule", "schedule"), (Scheduler, "update_from_output", "update")):
        time_calls(owner, name, key)
    from ngramrl.config import EngineConfig, NgramRLConfig
    from ngramrl.data.models import prepare_smollm2
    from ngramrl.engine import benchmark
    from ngramrl.engine.rollouts import PROPOSER, RolloutEngine, RolloutEngineConfig

    model = prepare_smollm2()
    prompts = benchmark._prompts("gsm", 4, model, None)
    prefetch = "off" if arm == "sync" else "auto"
    config = RolloutEngineConfig(model=model, draft="none" if arm == "none" else "ngramrl", num_speculative_tokens=8,
                                 proposer=benchmark.NO_DRAFT if arm == "floor" else PROPOSER,
                                 max_model_len=2048, seed=0, engine_args={"max_num_seqs": 32},
                                 ngramrl=NgramRLConfig(engine=EngineConfig(prefetch=prefetch)))
    engine = RolloutEngine(config)
    for epoch in range(2):
        engine.generate(prompts, n=8, epoch=epoch, temperature=0.6, max_tokens=160, seed=1000 * epoch)
    time_collections()
    spent.clear()
    tokens, seconds = 0, 0.0
    for epoch in range(2, 6):
        begin = time.perf_counter()
        rollouts = engine.generate(prompts, n=8, epoch=epoch, temperature=0.6, max_tokens=160, seed=7919 * epoch)
        seconds += time.perf_counter() - begin
        tokens += sum(len(r.output) for r in rollouts)
    result: dict[str, Any] = {"arm": arm, "tokens": tokens, "seconds": round(seconds, 2),
                              "tokens_per_s": round(tokens / seconds, 1)}
    result.update({key: value if key.endswith("_calls") else round(value / 1e6, 1)
                   for key, value in sorted(spent.items())})
    print(json.dumps(result), flush=True)
    engine.close()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "ngramrl")
