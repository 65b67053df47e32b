"""OpenRLHF's vLLM engine actor with ngramrl: prompt ids, rollouts to the pool, metrics."""

from __future__ import annotations

import asyncio
import contextvars
import copy
import hashlib
import json
import logging
import math
import os
from typing import Any

from openrlhf.trainer.ray import vllm_engine
from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

from ngramrl.engine.worker_extension import NgramRLWorkerExtension
from ngramrl.pipeline.feed import ShardFeed
from ngramrl.pipeline.metrics import RATES, counters, delta, draft_rates
from ngramrl.pipeline.pool import PoolSettings, shard_of
from ngramrl.pipeline.pool_proposer import POOL_ENV

# The class OpenRLHF decorated with @ray.remote.
_OpenRLHFRolloutActor = vllm_engine.RolloutRayActor.__ray_metadata__.modified_class.__mro__[1]
_prompt = contextvars.ContextVar("ngramrl_prompt", default=None)
EPOCH_TIMEOUT_S = 5.0  # a shard answers a visit in about a millisecond; one that hangs must not hold generation
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
        self._ngramrl_rates: dict[str, float] = dict.fromkeys(RATES, math.nan)  # each rate's last measure
        self._ngramrl_visits_fail = False
        settings = os.environ.get(POOL_ENV)
        self._ngramrl_feed: ShardFeed | None = None
        if settings:
            import ray

            self._ngramrl_feed = ShardFeed(PoolSettings.from_json(settings), ray)
        await super().__init__(*args, **kwargs)

    async def generate_responses(self, prompt: Any, label: Any, sampling_params: Any, max_length: int,
                                 hf_tokenizer: Any, num_samples: int = 1, images: Any = None) -> list[dict]:
        prompt_id = prompt_id_for(prompt, label)
        epoch = await self._ngramrl_epoch(prompt_id)
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

    async def _ngramrl_epoch(self, prompt_id: str) -> int:
        """This visit's epoch of the prompt: the count of the shard that owns it (every engine's
        visits), never below this engine's own; this engine's alone while the shard is down."""
        epoch = self._ngramrl_epochs.get(prompt_id, 0)
        if self._ngramrl_feed is not None:
            shards = self._ngramrl_feed.shards
            shard = shard_of(prompt_id, len(shards))
            try:
                handle = shards.get(shard)
                if handle is not None:
                    epoch = max(epoch, await asyncio.wait_for(handle.visit.remote(prompt_id), EPOCH_TIMEOUT_S))
                    self._ngramrl_visits_fail = False
            except Exception as err:  # noqa: BLE001 - the pool only serves drafts: generation goes on
                shards.failed(shard)  # the pool may have rebuilt it under its name: looked up again
                if not self._ngramrl_visits_fail:  # once until the pool counts again
                    logger.warning("ngramrl: the drafter pool did not count a visit of a prompt (%s); this "
                                   "engine counts its visits meanwhile", err)
                self._ngramrl_visits_fail = True
        self._ngramrl_epochs[prompt_id] = epoch + 1
        return epoch

    async def _ngramrl_metrics(self) -> dict[str, float]:
        """ngramrl's rates over this engine's steps since its last report, for OpenRLHF's logs."""
        try:
            # only the worker whose drafts vLLM reads has a proposer (the others answer None)
            replies = await self.llm.collective_rpc("ngramrl_stats")
            now = counters(next((reply for reply in replies if reply is not None), None))
        except Exception:  # noqa: BLE001 - metrics must never break generation
            return dict(self._ngramrl_rates)  # the window stays open: the next report counts its steps
        window, self._ngramrl_last = delta(now, self._ngramrl_last), now
        # A rate the window could not measure (no step since the last report, nothing drafted)
        # keeps its last value: every response carries every key (OpenRLHF stacks them by key),
        # NaN until a first measure, never a number that reads as one.
        for name, value in draft_rates(window).items():
            if value is not None:
                self._ngramrl_rates[name] = value
        return dict(self._ngramrl_rates)


def remote_actor_class() -> Any:
    import ray

    return ray.remote(NgramRLRolloutActor)
