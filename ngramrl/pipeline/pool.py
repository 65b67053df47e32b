"""The CPU drafter pool: Ray actors that own the rollout history, sharded by prompt id.

Each ``DrafterShard`` holds the history of the prompts that hash to it. The driver adds every
finished rollout (``DrafterPool.add_rollouts``); the engines' proposers (``PoolProposer``) send
each step's committed tokens, get drafts back, and, while the target verifies a draft, the shard
predicts the likely outcomes and looks up their next drafts (the prefetch). The pool saves the
shards' state, notices a dead shard, and rebuilds it from the last save plus the rollouts since.

A shard's history is a function of the finished rollouts alone (live sequences are dropped when
their request ends and the driver adds the finished rollout), so a rebuilt or restored shard
drafts exactly as the lost one would have.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ngramrl.config import DrafterConfig, NgramRLConfig
from ngramrl.core.batch import make_core
from ngramrl.core.drafter import Draft
from ngramrl.core.history import RolloutHistory, checked_rollout
from ngramrl.core.rows import DraftBatch
from ngramrl.core.trace import Rollout
from ngramrl.pipeline.journal import RolloutJournal

logger = logging.getLogger(__name__)

SNAPSHOT_VERSION = 2  # 2: the snapshot names its pool's shard count
RECENT = 2048         # latency samples kept per shard (actors live as long as the run)


class SnapshotError(ValueError):
    """A drafter snapshot that cannot be restored; the message names the file."""


def snapshot_path(snapshot_dir: str, index: int) -> str:
    return os.path.join(snapshot_dir, f"shard-{index}.json.gz")


def journal_path(snapshot: str) -> str:
    """Where the shard saving to ``snapshot`` journals the rollouts it takes until its next save."""
    return snapshot[:-len(".json.gz")] + ".journal.jsonl" if snapshot.endswith(".json.gz") else snapshot + ".journal"


def check_snapshots(snapshot_dir: str, shards: int) -> list[str]:
    """The snapshot files a pool of ``shards`` restores from ``snapshot_dir``, checked from their
    first bytes (quick: before anything starts) for being this pool's; a ``SnapshotError`` or
    ``FileNotFoundError`` naming the file otherwise. Loading checks the rest."""
    import glob
    import re

    for path in sorted(glob.glob(os.path.join(snapshot_dir, "shard-*.json.gz"))):
        index = os.path.basename(path)[len("shard-"):-len(".json.gz")]
        if not index.isdigit() or int(index) >= shards:
            raise SnapshotError(f"{path}: a snapshot of a pool of more shards; this pool has {shards} "
                                f"(pool.shards must be the saved pool's)")
    paths = []
    for index in range(shards):
        path = snapshot_path(snapshot_dir, index)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: no saved drafter shard {index} (was the pool saved with "
                                    f"{shards} shards?)")
        try:
            with gzip.open(path, "rt", encoding="utf-8") as handle:
                head = handle.read(120)
        except (OSError, EOFError, UnicodeDecodeError) as err:
            raise SnapshotError(f"{path}: not a readable drafter snapshot ({type(err).__name__}: {err})") from None
        found = re.match(r'\{"version": (\d+), "shard": (\d+), "shards": (\d+)', head)
        if found is None:
            raise SnapshotError(f"{path}: not a drafter snapshot of version {SNAPSHOT_VERSION} (it starts "
                                f"{head[:40]!r})")
        version, shard, count = map(int, found.groups())
        if version != SNAPSHOT_VERSION or shard != index or count != shards:
            raise SnapshotError(f"{path}: holds shard {shard} of a pool of {count} shards (version {version}); "
                                f"this is shard {index} of {shards}")
        paths.append(path)
    return paths


def shard_of(prompt_id: str, shards: int) -> int:
    """The shard that owns a prompt: a stable hash, the same in every process and run."""
    return zlib.crc32(prompt_id.encode("utf-8")) % shards


def shard_name(namespace_prefix: str, index: int) -> str:
    return f"{namespace_prefix}-drafter-{index}"


@dataclass
class StepItem:
    """One request's message to its shard in one engine step."""

    request_id: str
    prompt_id: str
    committed: list[int]              # tokens the target committed since the last message
    k: int                            # the most draft tokens wanted now (0: commit only)
    prompt: list[int] | None = None   # sent when the shard may not know the request yet
    before: list[int] | None = None   # output tokens committed before ``committed`` (with ``prompt``)
    verified: int | None = None       # how much of the last draft was sent for verification
    hit: bool = False                 # the engine used the prefetched draft for this outcome


@dataclass
class StepReply:
    request_id: str
    tokens: list[int]
    probs: list[float]
    known: bool = True                # False: the shard lost this request; resend it with its prompt


@dataclass
class ShardStats:
    rollouts: int = 0
    steps: int = 0
    drafts: int = 0
    prefetched: int = 0
    step_us: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    prefetch_us: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))


class DrafterShard:
    """The history and live requests of one shard of prompts (a Ray actor in the pipeline), on the
    same drafting core as the in-engine proposer (``ngramrl.core.batch``)."""

    def __init__(self, index: int, config: NgramRLConfig, stop_tokens: tuple[int, ...] = (), shards: int = 1,
                 journal: str | None = None) -> None:
        """``journal``: the file where every rollout this shard takes is written first, until its
        next ``save`` (so a shard that dies is rebuilt from its snapshot and journal, whoever fed
        it: the driver, or OpenRLHF's engines directly). A new shard never empties it: ``load``
        and ``replay_journal`` read it back."""
        if not 0 <= index < shards:
            raise ValueError(f"shard {index} of {shards}: the index must be in [0, {shards})")
        self.index = index
        self.shards = shards
        self.config = config
        self.drafter_config = DrafterConfig(**{**config.drafter.__dict__,
                                               "stop_tokens": tuple(sorted(set(config.drafter.stop_tokens)
                                                                           | set(stop_tokens)))})
        self.stats = ShardStats()
        self.journal = RolloutJournal(journal) if journal else None
        self._empty()

    def _empty(self) -> None:
        """No history and no requests in flight."""
        self.core = make_core(self.config.history, self.drafter_config, self.config.prefetch,
                              threads=self.config.engine.draft_threads)
        self.requests: dict[str, int] = {}                         # request id -> core handle
        self.issued: dict[str, Draft] = {}                        # the draft each request is verifying

    # -- history ----------------------------------------------------------------------------

    def add_rollouts(self, rollouts: list[tuple[str, list[int], list[int], int]]) -> int:
        """Finished rollouts (prompt_id, prompt, output, epoch) enter the history (and the journal
        first). Every one is checked first: a bad one is refused with its place in the list, and
        nothing of the call is journaled or taken (a journaled bad rollout would fail every
        rebuild of the shard)."""
        rollouts = [(str(prompt_id), *checked_rollout(prompt, output, epoch, f"rollouts[{i}] "))
                    for i, (prompt_id, prompt, output, epoch) in enumerate(rollouts)]
        if self.journal is not None:
            self.journal.append(rollouts)
        return self._take(rollouts)

    def _take(self, rollouts: list[tuple[str, list[int], list[int], int]]) -> int:
        touched = {}
        for prompt_id, prompt, output, epoch in rollouts:
            self.core.add_rollout(prompt_id, prompt, output, epoch)
            touched[prompt_id] = None
        for prompt_id in touched:
            self.core.index_prompt(prompt_id)  # rebuild now, between steps, not in the next one
        self.stats.rollouts += len(rollouts)
        return self.stats.rollouts

    def snapshot(self) -> dict[str, Any]:
        return {"version": SNAPSHOT_VERSION, "shard": self.index, "shards": self.shards,
                "prompts": self.core.export()}

    def save(self, path: str) -> str:
        tmp = f"{path}.tmp"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with gzip.open(tmp, "wt", encoding="utf-8") as handle:
            json.dump(self.snapshot(), handle)
        os.replace(tmp, path)
        if self.journal is not None:  # the snapshot holds everything journaled so far
            self.journal.reset()
        return path

    def replay_journal(self) -> int:
        """Take the rollouts this shard's journal holds (those since its last save) again."""
        if self.journal is None:
            return 0
        records = self.journal.read()
        self._take(records)
        return len(records)

    def load(self, path: str) -> int:
        """Restore the history saved at ``path`` (replaces this shard's history). The snapshot must
        be this shard's, saved by a pool of as many shards, and hold only prompts this shard owns;
        anything else is a ``SnapshotError`` naming the file, and leaves the history as it was."""
        try:
            with gzip.open(path, "rt", encoding="utf-8") as handle:
                data = json.load(handle)
        except (OSError, EOFError, UnicodeDecodeError, ValueError) as err:
            raise SnapshotError(f"{path}: not a readable drafter snapshot ({type(err).__name__}: {err})") from None
        if not isinstance(data, dict) or "version" not in data:
            raise SnapshotError(f"{path}: not a drafter snapshot (no version)")
        if data["version"] != SNAPSHOT_VERSION:
            raise SnapshotError(f"{path}: drafter snapshot version {data['version']!r}, this ngramrl reads version "
                                f"{SNAPSHOT_VERSION}")
        if data.get("shard") != self.index or data.get("shards") != self.shards:
            raise SnapshotError(f"{path}: holds shard {data.get('shard')!r} of a pool of {data.get('shards')!r} "
                                f"shards; this is shard {self.index} of {self.shards} (prompts are spread over "
                                f"the shards by a hash of their id, so a pool restores only its own shards)")
        prompts = data.get("prompts")
        history = RolloutHistory(self.config.history)  # a scratch restore: a bad file leaves the core as it was
        try:
            if not isinstance(prompts, list):
                raise ValueError("'prompts' is not a list")
            for entry in prompts:
                if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)):
                    raise ValueError(f"a prompt entry is not [prompt_id, prompt, rollouts]: {str(entry)[:80]}")
                if shard_of(entry[0], self.shards) != self.index:
                    raise ValueError(f"prompt {entry[0]!r} belongs to shard {shard_of(entry[0], self.shards)}")
            history.restore(prompts)
        except (ValueError, TypeError) as err:
            raise SnapshotError(f"{path}: not a valid drafter snapshot ({err})") from None
        self._empty()
        self.core.restore(prompts)
        beside = RolloutJournal(journal_path(path))  # what the shard that saved it took after the save
        if self.journal is None or os.path.abspath(beside.path) != os.path.abspath(self.journal.path):
            self._take(beside.read())
        self.replay_journal()
        return len(self.core)

    # -- engine steps -----------------------------------------------------------------------

    def step(self, items: list[StepItem], finished: list[str]) -> list[StepReply]:
        """Commit each request's new tokens and return its next draft (``k`` tokens at most): one
        core step for the shard's rows; their tokens enter the index right after it."""
        begin = time.perf_counter()
        self._drop(finished)
        rows: list[StepItem] = []
        lost: set[str] = set()
        starting: dict[str, StepItem] = {}  # the step's new requests, started in one core call
        for item in items:
            if item.request_id not in self.requests:
                if item.prompt is None:
                    lost.add(item.request_id)
                    continue
                starting[item.request_id] = item
            else:
                self._observe(item)
            rows.append(item)
        if starting:
            new = list(starting.values())
            handles = self.core.start_many([item.prompt_id for item in new], [item.prompt for item in new],
                                           [item.before or [] for item in new], register=True)
            self.requests.update(zip(starting, handles, strict=True))
        drafts: dict[str, Draft] = {}
        if rows:
            handles = [self.requests[item.request_id] for item in rows]
            offsets = np.zeros(len(rows) + 1, dtype=np.int64)
            np.cumsum([len(item.committed) for item in rows], out=offsets[1:])
            batch = self.core.step(handles, [t for item in rows for t in item.committed], offsets,
                                   [item.k for item in rows])
            self.core.absorb(handles, now=True)
            for item, draft in zip(rows, batch.drafts(), strict=True):
                drafts[item.request_id] = draft
                self.issued[item.request_id] = drafts[item.request_id]
                self.stats.drafts += bool(drafts[item.request_id].tokens)
        replies = [StepReply(item.request_id, [], [], known=False) if item.request_id in lost
                   else StepReply(item.request_id, drafts[item.request_id].tokens, drafts[item.request_id].probs)
                   for item in items]
        self.stats.steps += 1
        self.stats.step_us.append((time.perf_counter() - begin) * 1e6)
        return replies

    def _observe(self, item: StepItem) -> None:
        """The last draft's outcome is now known: calibrate on it (causal: it is in the past)."""
        issued = self.issued.get(item.request_id)
        if issued is None or not issued.tokens:
            return
        if item.verified is not None:
            issued = issued.truncated(item.verified)
            self.issued[item.request_id] = issued
        accepted = len(item.committed) - 1
        if 0 <= accepted <= len(issued.tokens) and item.committed[:accepted] == issued.tokens[:accepted]:
            self.core.observe(issued.probs, [0, len(issued.probs)], [accepted])

    def prefetch(self, request_ids: list[str], k: int, verified: list[int] | None = None,
                 ) -> dict[str, list[tuple[int, int, list[int], list[float]]]]:
        """While the engine verifies: the next drafts of each request's likeliest outcomes (the
        core's outcome model and allocator; they are the drafts its next step makes for them).
        ``verified``: how much of each request's last draft went to verification (None: all of
        it); a request sent none of it (or given none) has one outcome to guess, its next token."""
        begin = time.perf_counter()
        if verified is not None and len(verified) != len(request_ids):
            raise ValueError(f"prefetch: {len(verified)} verified lengths for {len(request_ids)} requests")
        sent: list[str] = []
        drafts: list[Draft] = []
        for n, rid in enumerate(request_ids):
            issued = self.issued.get(rid)
            if rid in self.requests and issued is not None:
                sent.append(rid)
                drafts.append(issued if verified is None else issued.truncated(verified[n]))
        out: dict[str, list[tuple[int, int, list[int], list[float]]]] = {}
        if sent:
            batch = DraftBatch.from_drafts(drafts)
            self.core.prefetch([self.requests[rid] for rid in sent], batch.tokens, batch.offsets, batch.probs, k)
            found = self.core.collect()
            for n in range(len(found)):
                out.setdefault(sent[int(found.rows[n])], []).append(
                    (int(found.accepted[n]), int(found.token[n]), *_listed(found.drafts.draft(n))))
            self.stats.prefetched += len(found)
        self.stats.prefetch_us.append((time.perf_counter() - begin) * 1e6)
        return out

    def _drop(self, request_ids: list[str]) -> None:
        handles = []
        for request_id in request_ids:
            handle = self.requests.pop(request_id, None)
            self.issued.pop(request_id, None)
            if handle is not None:
                handles.append(handle)
        if handles:
            self.core.finish_many(handles, None, linger=True)  # the driver adds the finished rollouts

    def lookup(self, prompt_id: str, prompt: list[int], output: list[int], k: int) -> tuple[list[int], list[float]]:
        """The draft after ``output`` from the current history, changing nothing."""
        draft = self.core.lookup_context(prompt_id, prompt, output, k)
        return draft.tokens, draft.probs

    def health(self) -> dict[str, Any]:
        import statistics

        stats = self.stats
        return {"shard": self.index, "pid": os.getpid(), "prompts": len(self.core), "native": self.core.native,
                "stored_tokens": self.core.stored_tokens, "rollouts": stats.rollouts, "steps": stats.steps,
                "live_requests": len(self.requests), "prefetched": stats.prefetched,
                "step_us_median": statistics.median(stats.step_us) if stats.step_us else None,
                "prefetch_us_median": statistics.median(stats.prefetch_us) if stats.prefetch_us else None}


def _listed(draft: Draft) -> tuple[list[int], list[float]]:
    return list(draft.tokens), list(draft.probs)


@dataclass
class PoolSettings:
    """What the engines' proposers need to reach the pool (sent to them as JSON)."""

    names: list[str]
    namespace: str
    address: str | None = None
    draft_timeout_ms: float = 50.0
    retry_after_s: float = 2.0

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> PoolSettings:
        return cls(**json.loads(text))


class DrafterPool:
    """The driver's handle on the shards: routing, saving, health checks and restarts."""

    def __init__(self, shards: int, config: NgramRLConfig, stop_tokens: tuple[int, ...], namespace: str,
                 snapshot_dir: str, name_prefix: str = "ngramrl", draft_timeout_ms: float = 50.0,
                 num_cpus: float = 0.25) -> None:
        import ray

        self.ray = ray
        self.config = config
        self.stop_tokens = tuple(stop_tokens)
        self.namespace = namespace
        self.snapshot_dir = snapshot_dir
        self.names = [shard_name(name_prefix, i) for i in range(shards)]
        self.num_cpus = num_cpus
        self.draft_timeout_ms = draft_timeout_ms
        self.actor_class = ray.remote(num_cpus=num_cpus, max_restarts=0)(DrafterShard)
        self.handles = [self._create(i) for i in range(shards)]
        self.saved: list[str | None] = [None] * shards
        self.restarts = 0
        self.restarted_shards: list[int] = []

    def _create(self, index: int) -> Any:
        return self.actor_class.options(name=self.names[index], namespace=self.namespace, lifetime=None).remote(
            index, self.config, self.stop_tokens, len(self.names),
            journal=journal_path(snapshot_path(self.snapshot_dir, index)))

    def settings(self) -> PoolSettings:
        context = self.ray.get_runtime_context()
        address = getattr(context, "gcs_address", None)
        return PoolSettings(self.names, self.namespace, address, self.draft_timeout_ms)

    def add_rollouts(self, rollouts: list[Rollout]) -> None:
        """The rollouts go to their prompts' shards; every one is checked before any is sent (a
        shard refusing one would look like a shard that died)."""
        by_shard: list[list[tuple[str, list[int], list[int], int]]] = [[] for _ in self.names]
        for rollout in rollouts:
            where = f"rollout of prompt {rollout.prompt_id!r} (epoch {rollout.epoch}, sample {rollout.sample}) "
            record = (rollout.prompt_id, *checked_rollout(rollout.prompt, rollout.output, rollout.epoch, where))
            by_shard[shard_of(rollout.prompt_id, len(self.names))].append(record)
        refs = []
        for index, records in enumerate(by_shard):
            if records:
                refs.append((index, self.handles[index].add_rollouts.remote(records)))
        for index, ref in refs:
            try:
                self.ray.get(ref, timeout=120)
            except Exception as err:  # noqa: BLE001 - a dead shard is rebuilt by heal()
                logger.warning("drafter shard %d did not take rollouts (%s); it will be rebuilt", index, err)

    def save(self, timeout_s: float = 300.0) -> list[str | None]:
        """Every live shard saves its history (and empties its journal). Returns
        each shard's snapshot path, None for a shard that could not save now (its last snapshot,
        if any, stays on disk)."""
        refs = []
        for index, handle in enumerate(self.handles):
            path = snapshot_path(self.snapshot_dir, index)
            refs.append((index, path, handle.save.remote(path)))
        saved: list[str | None] = [None] * len(self.handles)
        deadline = time.monotonic() + timeout_s
        for index, path, ref in refs:
            try:
                self.ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except Exception as err:  # noqa: BLE001
                logger.warning("drafter shard %d could not save (%s)", index, err)
                continue
            self.saved[index] = saved[index] = path
        return saved

    def restore(self, snapshot_dir: str, timeout_s: float = 600.0) -> int:
        """Load every shard's saved history from ``snapshot_dir`` (a resumed run starts warm); a
        snapshot of another shard or shard count, or a damaged one, is refused naming its file."""
        paths = check_snapshots(snapshot_dir, len(self.handles))
        refs = [(path, handle.load.remote(path)) for path, handle in zip(paths, self.handles, strict=True)]
        restored = sum(self._result(ref, f"restoring {path}", timeout_s) for path, ref in refs)
        self.saved = list(paths)  # a shard lost before its first save here is rebuilt from these
        return restored

    def _result(self, ref: Any, what: str, timeout_s: float) -> Any:
        """A shard call's result within ``timeout_s``; the shard's own error (not Ray's wrapper)."""
        try:
            return self.ray.get(ref, timeout=timeout_s)
        except self.ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"drafter pool: {what} did not finish within {timeout_s:.0f} s") from None
        except self.ray.exceptions.RayTaskError as err:
            cause = getattr(err, "cause", None)
            if isinstance(cause, Exception):
                raise cause from None
            raise

    def health(self, timeout_s: float = 10.0) -> list[dict[str, Any] | None]:
        """Each shard's health report, None for a shard that did not answer in time."""
        refs = [handle.health.remote() for handle in self.handles]
        reports: list[dict[str, Any] | None] = []
        for ref in refs:
            try:
                reports.append(self.ray.get(ref, timeout=timeout_s))
            except Exception:  # noqa: BLE001
                reports.append(None)
        return reports

    def heal(self, timeout_s: float = 10.0) -> list[int]:
        """Restart shards that died (or hang), rebuilt from their last save plus their journal of the
        rollouts since (written by the shard itself, whoever fed it)."""
        restarted = []
        for index, report in enumerate(self.health(timeout_s)):
            if report is not None:
                continue
            logger.warning("drafter shard %d is down: restarting it", index)
            try:
                self.ray.kill(self.handles[index], no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
            self.handles[index] = self._wait_create(index)
            if self.saved[index] is not None:
                self._result(self.handles[index].load.remote(self.saved[index]), f"reloading {self.saved[index]}",
                             600.0)
            else:
                self._result(self.handles[index].replay_journal.remote(),
                             f"replaying shard {index}'s journal of the rollouts since its last save", 600.0)
            restarted.append(index)
        self.restarts += len(restarted)
        self.restarted_shards.extend(restarted)
        return restarted

    def _wait_create(self, index: int) -> Any:
        """Create the shard again under its name (the dead actor's name is freed asynchronously)."""
        deadline = time.time() + 30
        while True:
            try:
                return self._create(index)
            except ValueError:
                if time.time() > deadline:
                    raise
                time.sleep(0.2)

    def lookup(self, prompt_id: str, prompt: list[int], output: list[int], k: int,
               timeout_s: float = 60.0) -> tuple[list[int], list[float]]:
        index = shard_of(prompt_id, len(self.handles))
        return self._result(self.handles[index].lookup.remote(prompt_id, prompt, output, k),
                            f"a lookup on shard {index}", timeout_s)

    def shutdown(self) -> None:
        for handle in self.handles:
            try:
                self.ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
