"""Rollout workers: Ray actors, each holding one vLLM engine whose proposer drafts from the pool."""

from __future__ import annotations

import os
import time
from typing import Any

from ngramrl.config import NgramRLConfig
from ngramrl.core.trace import Rollout
from ngramrl.engine.rollouts import PROPOSER, PromptSpec, RolloutEngine, RolloutEngineConfig
from ngramrl.pipeline.config import RolloutSection
from ngramrl.pipeline.metrics import counters, delta
from ngramrl.pipeline.pool import PoolSettings
from ngramrl.pipeline.pool_proposer import POOL_ENV, POOL_PROPOSER


class RolloutWorker:
    def __init__(self, index: int, model_dir: str, rollout: RolloutSection, ngramrl: NgramRLConfig,
                 pool: PoolSettings | None, dtype: str, seed: int) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(rollout.cpu_kv_cache_gib))
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if rollout.engine_in_process else "1"
        if pool is not None:
            os.environ[POOL_ENV] = pool.to_json()
        self.index = index
        self.rollout = rollout
        engine_args = {"enforce_eager": True, **rollout.engine_args}  # RolloutEngine adds the worker extension
        self.engine = RolloutEngine(RolloutEngineConfig(
            model=model_dir, draft=rollout.draft, num_speculative_tokens=rollout.num_speculative_tokens,
            max_model_len=rollout.max_model_len, dtype=dtype, seed=seed + index,
            proposer=POOL_PROPOSER if pool is not None else PROPOSER, ngramrl=ngramrl, engine_args=engine_args))
        self._last = self._counters()
        self._last_spec = self.engine.spec_decode_metrics()

    def _counters(self) -> dict[str, float]:
        return counters(self.engine.proposer_stats())

    def generate(self, prompts: list[PromptSpec], n: int, epoch: dict[str, int], seed: int | None) -> dict[str, Any]:
        """Sample ``n`` rollouts of each prompt; returns them with this call's engine metrics."""
        rollout = self.rollout
        # the prompts' history comes from the drafter pool now, before the first step
        self.engine.llm.collective_rpc("ngramrl_new_batch", args=({p.prompt_id: list(p.token_ids) for p in prompts},))
        begin = time.perf_counter()
        rollouts: list[Rollout] = self.engine.generate(
            prompts, n=n, epoch=epoch, temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
            max_tokens=rollout.max_tokens, seed=seed)
        seconds = time.perf_counter() - begin
        now, spec = self._counters(), self.engine.spec_decode_metrics()
        metrics = delta(now, self._last)
        metrics.update({f"vllm_{name}": spec.get(name, 0.0) - self._last_spec.get(name, 0.0) for name in spec})
        metrics["seconds"] = seconds
        metrics["tokens"] = float(sum(len(r.output) for r in rollouts))
        self._last, self._last_spec = now, spec
        return {"rollouts": rollouts, "metrics": metrics}

    def load_weights(self, weights: dict[str, Any]) -> int:
        """New policy weights: load them in place and forget cached prefixes computed with the old ones."""
        loaded = self.engine.llm.collective_rpc("ngramrl_load_weights", args=(weights,))[0]
        self.engine.llm.reset_prefix_cache()
        return loaded

    def param_sums(self, names: list[str]) -> dict[str, float]:
        return self.engine.llm.collective_rpc("ngramrl_param_sums", args=(names,))[0]

    def dtype(self) -> str:
        """The dtype this engine runs in (``rollout_dtype`` resolved on its device)."""
        return self.engine.dtype

    def eos_token_ids(self) -> list[int]:
        tokenizer = self.engine.llm.get_tokenizer()
        return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def close(self) -> None:
        self.engine.close()
