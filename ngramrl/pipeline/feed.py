"""Finished rollouts sent from an engine to the drafter pool's shards, without waiting.

With OpenRLHF the engines feed the pool themselves, one rollout at a time as each finishes; waiting
for each shard's reply would hold the engine's event loop. A call to a shard that died fails only
in its reply, so the replies are read at the next send: a failed call's rollouts wait until the
shard's name finds a live actor (the pool rebuilds a lost shard under its name) and are sent
again, and no shard goes on being fed through a handle to a lost actor.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ngramrl.pipeline.pool import PoolSettings, ShardHandles, shard_of

logger = logging.getLogger(__name__)

Record = tuple[str, list[int], list[int], int]  # (prompt id, prompt, output, epoch)


@dataclass
class FeedStats:
    sent: int = 0      # rollouts sent in a call (again after a failure: counted again)
    resent: int = 0    # rollouts sent again after their shard's call failed
    dropped: int = 0   # rollouts given up: their shard stayed down while more than max_waiting waited


class ShardFeed:
    """``send`` a finished rollout to the shard that owns its prompt. ``max_waiting``: rollouts kept
    per shard while it is down (the oldest go first beyond it: the history keeps recent ones)."""

    def __init__(self, settings: PoolSettings, ray: Any, max_waiting: int = 4096) -> None:
        self.ray = ray
        self.max_waiting = max_waiting
        self.stats = FeedStats()
        self.shards = ShardHandles(settings, ray)
        self._in_flight: list[tuple[int, Any, list[Record]]] = []  # (shard, reply, its rollouts)
        self._waiting: dict[int, list[Record]] = {}  # per shard: rollouts not in a call now

    def send(self, prompt_id: str, prompt: list[int], output: list[int], epoch: int) -> None:
        self._read_replies()
        shard = shard_of(prompt_id, len(self.shards))
        self._waiting.setdefault(shard, []).append((prompt_id, prompt, output, epoch))
        for waiting in [index for index, records in self._waiting.items() if records]:
            self._flush(waiting)

    def waiting(self) -> int:
        """Rollouts not yet in a call (their shards are down)."""
        return sum(map(len, self._waiting.values()))

    def _read_replies(self) -> None:
        if not self._in_flight:
            return
        ready, _ = self.ray.wait([reply for _, reply, _ in self._in_flight], num_returns=len(self._in_flight),
                                 timeout=0)
        done = {id(reply) for reply in ready}
        still: list[tuple[int, Any, list[Record]]] = []
        for shard, reply, records in self._in_flight:
            if id(reply) not in done:
                still.append((shard, reply, records))
                continue
            try:
                self.ray.get(reply)
            except self.ray.exceptions.RayError as err:
                logger.warning("drafter shard %d did not take %d rollouts (%s); they go to it again once it is "
                               "back", shard, len(records), err)
                self.shards.failed(shard)
                self._waiting[shard] = records + self._waiting.get(shard, [])
                self.stats.resent += len(records)
        self._in_flight = still

    def _flush(self, shard: int) -> None:
        records = self._waiting[shard]
        handle = self.shards.get(shard)
        if handle is not None:
            try:
                reply = handle.add_rollouts.remote(records)
            except self.ray.exceptions.RayError:
                self.shards.failed(shard)
            else:
                self._in_flight.append((shard, reply, records))
                self._waiting[shard] = []
                self.stats.sent += len(records)
                return
        if len(records) > self.max_waiting:
            self.stats.dropped += len(records) - self.max_waiting
            del records[:len(records) - self.max_waiting]
