"""OpenRLHF's vLLM engine actor with ngramrl: prompt ids, rollouts to the pool, metrics."""

from __future__ import annotations

import contextvars
import copy
import hashlib
import json
import logging
import os
from typing import Any

from openrlhf.trainer.ray import vllm_engine
from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

from ngramrl.engine.worker_extension import NgramRLWorkerExtension
from ngramrl.pipeline.feed import ShardFeed
from ngramrl.pipeline.metrics import counters, delta, draft_rates
from ngramrl.pipeline.pool import PoolSettings
from ngramrl.pipeline.pool_proposer import POOL_ENV

# The class OpenRLHF decorated with @ray.remote.
_OpenRLHFRolloutActor = vllm_engine.RolloutRayActor.__ray_metadata__.modified_class.__mro__[1]
_prompt = contextvars.ContextVar("ngramrl_prompt", default=None)
logger = logging.getLogger("ngramrl")


def prompt_id_for(prompt: Any, label: Any = None) -> str:
    """A stable id for a prompt (the same text and label get the same id in every engine and run)."""
    text = json.dumps([prompt, label], sort_keys=True, default=str)
    return "p" + hashlib.blake2b(text.encode("utf-8"), digest_size=10).hexdigest()


class NgramRLWorkerWrap(WorkerWrap, NgramRLWorkerExtension):
    """OpenRLHF's weight-sync worker methods plus ngramrl's (stats)."""


class NgramRLRolloutActor(_OpenRLHFRolloutActor):
    async def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._ngramrl_epochs: dict[str, int] = {}
        self._ngramrl_last: dict[str, float] = {}
        settings = os.environ.get(POOL_ENV)
        self._ngramrl_feed: ShardFeed | None = None
        if settings:
            import ray

            self._ngramrl_feed = ShardFeed(PoolSettings.from_json(settings), ray)
        await super().__init__(*args, **kwargs)

    async def generate_responses(self, prompt: Any, label: Any, sampling_params: Any, max_length: int,
                                 hf_tokenizer: Any, num_samples: int = 1, images: Any = None) -> list[dict]:
        prompt_id = prompt_id_for(prompt, label)
        epoch = self._ngramrl_epochs.get(prompt_id, 0)
        self._ngramrl_epochs[prompt_id] = epoch + 1
        token = _prompt.set((prompt_id, epoch))  # read by generate() in every sample's task
        try:
            responses = await super().generate_responses(prompt, label, sampling_params, max_length, hf_tokenizer,
                                                         num_samples, images)
        finally:
            _prompt.reset(token)
        metrics = await self._ngramrl_metrics()
        for response in responses:
            logs = dict(response.get("extra_logs") or {})
            logs.update({f"ngramrl_{name}": value for name, value in metrics.items()})
            response["extra_logs"] = logs
        return responses

    async def generate(self, prompt_token_ids: list[int], sampling_params: Any, multi_modal_data: Any = None) -> Any:
        prompt_id, epoch = _prompt.get() or (prompt_id_for(list(prompt_token_ids)), 0)
        params = copy.deepcopy(sampling_params)
        params.extra_args = {**(params.extra_args or {}), "prompt_id": prompt_id, "epoch": epoch}
        output = await super().generate(prompt_token_ids, params, multi_modal_data)
        if output is not None and output.outputs and self._ngramrl_feed is not None:
            try:  # to the shard that owns the prompt, without waiting (ShardFeed)
                self._ngramrl_feed.send(prompt_id, list(prompt_token_ids), list(output.outputs[0].token_ids), epoch)
            except Exception:  # noqa: BLE001 - the pool only serves drafts: it must never break generation
                logger.exception("ngramrl: a rollout did not go to the drafter pool")
        return output

    async def _ngramrl_metrics(self) -> dict[str, float]:
        """ngramrl's rates over this engine's steps since its last report, for OpenRLHF's logs."""
        try:
            # only the worker whose drafts vLLM reads has a proposer (the others answer None)
            replies = await self.llm.collective_rpc("ngramrl_stats")
            now = counters(next((reply for reply in replies if reply is not None), None))
        except Exception:  # noqa: BLE001 - metrics must never break generation
            now = counters(None)
        window, self._ngramrl_last = delta(now, self._ngramrl_last), now
        return draft_rates(window)


def remote_actor_class() -> Any:
    import ray

    return ray.remote(NgramRLRolloutActor)
