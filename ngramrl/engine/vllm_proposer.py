"""ngramrl as a vLLM speculative proposer.

    LLM(model, speculative_config={"method": "custom_class",
                                   "model": "ngramrl.engine.vllm_proposer.NgramRLProposer",
                                   "num_speculative_tokens": 8})

Requests name their prompt in ``SamplingParams(extra_args={"prompt_id": ..., "epoch": ...})``;
requests without one decode as usual with no drafts. The rollout history lives in the engine
process next to the model runner: every request in flight is a live sequence of its prompt
(siblings share their tokens at once) and becomes a finished rollout of its epoch when it leaves
the runner. Settings come from ``NGRAMRL_CONFIG`` (JSON of ``NgramRLConfig``), the one channel that
reaches the engine process; ``RolloutEngine`` sets it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from ngramrl.config import DrafterConfig, HistoryConfig, NgramRLConfig, PrefetchConfig
from ngramrl.core.drafter import NgramDrafter, RequestState
from ngramrl.core.history import RolloutHistory

CONFIG_ENV = "NGRAMRL_CONFIG"


def config_to_env(config: NgramRLConfig) -> str:
    return json.dumps({"history": config.history.__dict__,
                       "drafter": {**config.drafter.__dict__, "stop_tokens": list(config.drafter.stop_tokens)},
                       "prefetch": config.prefetch.__dict__})


def config_from_env(value: str | None) -> NgramRLConfig:
    if not value:
        return NgramRLConfig()
    try:
        raw = json.loads(value)
        drafter = dict(raw.get("drafter", {}))
        drafter["stop_tokens"] = tuple(drafter.get("stop_tokens", ()))
        return NgramRLConfig(HistoryConfig(**raw.get("history", {})), DrafterConfig(**drafter),
                             PrefetchConfig(**raw.get("prefetch", {})))
    except (ValueError, TypeError) as err:
        raise ValueError(f"{CONFIG_ENV} is not a valid ngramrl configuration: {err}") from None


@dataclass
class ProposerStats:
    steps: int = 0
    drafts: int = 0
    drafted_tokens: int = 0
    finished_rollouts: int = 0
    draft_ns: list[int] = field(default_factory=list)


def _eos_ids(vllm_config: Any) -> tuple[int, ...]:
    eos = getattr(vllm_config.model_config.hf_config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


class NgramRLProposer:
    """vLLM ``custom_class`` proposer drafting from per-prompt rollout history."""

    def __init__(self, vllm_config: Any) -> None:
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.config = config_from_env(os.environ.get(CONFIG_ENV))
        stops = tuple(sorted(set(self.config.drafter.stop_tokens) | set(_eos_ids(vllm_config))))
        drafter_config = DrafterConfig(**{**self.config.drafter.__dict__, "stop_tokens": stops})
        self.history = RolloutHistory(self.config.history)
        self.drafter = NgramDrafter(self.history, drafter_config)
        self.runner: Any = None
        self.requests: dict[str, RequestState | None] = {}  # None: a request without a prompt id
        self.epochs: dict[str, int] = {}
        self.stats = ProposerStats()

    def bind_runner(self, runner: Any) -> None:
        self.runner = runner

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load: the drafter is the history."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any, token_ids_cpu: Any,
                slot_mappings: Any = None) -> list[list[int]]:
        runner = self.runner
        if runner is None:
            return [[] for _ in sampled_token_ids]
        begin = time.perf_counter_ns()
        self._retire(runner.requests)
        req_ids = runner.input_batch.req_ids
        drafts: list[list[int]] = []
        for row, sampled in enumerate(sampled_token_ids):
            req_id = req_ids[row]
            if req_id not in self.requests:
                self._admit(req_id, runner.requests.get(req_id), sampled)
            request = self.requests.get(req_id)
            if request is None or not sampled:
                drafts.append([])
                continue
            self.drafter.commit(request, list(sampled))
            room = self.max_model_len - int(num_tokens_no_spec[row]) - 1
            k = min(self.k, room)
            tokens = self.drafter.propose(request, k).tokens if k > 0 else []
            drafts.append(tokens)
            self.stats.drafts += bool(tokens)
            self.stats.drafted_tokens += len(tokens)
        self.stats.steps += 1
        self.stats.draft_ns.append(time.perf_counter_ns() - begin)
        return drafts

    def _admit(self, req_id: str, cached: Any, sampled: list[int]) -> None:
        """First sight of a request: start it as a live sequence of its prompt."""
        params = getattr(cached, "sampling_params", None) if cached is not None else None
        extra = (getattr(params, "extra_args", None) or {}) if params is not None else {}
        prompt_id = extra.get("prompt_id")
        prompt = getattr(cached, "prompt_token_ids", None) if cached is not None else None
        if prompt_id is None or prompt is None:
            self.requests[req_id] = None
            return
        produced = list(getattr(cached, "output_token_ids", []) or [])
        before = produced[: max(0, len(produced) - len(sampled))]  # tokens from before this step
        self.requests[req_id] = self.drafter.start(req_id, str(prompt_id), list(prompt), before, register=True)
        self.epochs[req_id] = int(extra.get("epoch", 0))

    def _retire(self, live: dict[str, Any]) -> None:
        """Requests that left the runner are finished: their outputs become rollouts of their epoch."""
        for req_id in [rid for rid in self.requests if rid not in live]:
            request = self.requests.pop(req_id)
            epoch = self.epochs.pop(req_id, 0)
            if request is not None:
                self.drafter.finish(request, epoch=epoch)
                self.stats.finished_rollouts += 1
