"""Profile one generate call of an in-process vLLM engine, with or without ngramrl.

    python scripts/profile_engine.py none      > none.txt
    python scripts/profile_engine.py ngramrl   > ngramrl.txt
    python scripts/profile_engine.py ngramrl 8 > ngramrl-8.txt   # 8 requests in flight

One warm-up epoch (4 GSM prompts x 8 samples, SmolLM2-135M-Instruct), then the next epoch at 32
(or the second argument) requests in flight under cProfile; prints the functions by cumulative time and writes
``profile-<method>.pstats``. Comparing the two runs' ``propose`` and engine-step times is how
docs/vllm.md attributes the gap at 32 in flight.
"""

import cProfile
import io
import os
import pstats
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, so cProfile sees it
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")


def main(method: str, concurrency: int) -> None:
    from ngramrl.data.models import prepare_smollm2
    from ngramrl.engine import benchmark
    from ngramrl.engine.rollouts import RolloutEngine, RolloutEngineConfig

    model = prepare_smollm2()
    prompts = benchmark._prompts("gsm", 4, model, None)
    engine = RolloutEngine(RolloutEngineConfig(model=model, draft=method, num_speculative_tokens=8,
                                               max_model_len=2048, seed=0, engine_args={"max_num_seqs": concurrency}))
    engine.generate(prompts, n=8, epoch=0, temperature=0.6, max_tokens=160, seed=1)
    profile = cProfile.Profile()
    begin = time.perf_counter()
    profile.enable()
    rollouts = engine.generate(prompts, n=8, epoch=1, temperature=0.6, max_tokens=160, seed=2)
    profile.disable()
    print(method, "tokens", sum(len(r.output) for r in rollouts), "seconds", round(time.perf_counter() - begin, 2))
    profile.dump_stats(f"profile-{method}.pstats")
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats("ngramrl/|propose|sample|core.py")
    print(out.getvalue())


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "ngramrl", int(sys.argv[2]) if len(sys.argv) > 2 else 32)
