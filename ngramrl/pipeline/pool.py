"""The CPU drafter pool: Ray actors that own the rollout history, sharded by prompt id.

Each ``DrafterShard`` holds the history of the prompts that hash to it. The driver adds every
finished rollout (``DrafterPool.add_rollouts``); each engine drafts from a copy of the windows of
the prompts it runs, in its own drafting core (``PoolProposer``), and brings a prompt's copy up to
date (``DrafterShard.sync``: the rollouts it lacks) when a request of it starts there with no
sibling running. The pool saves the shards' state, notices a dead shard, and rebuilds it from the
last save plus the rollouts since.

A shard's history is a function of the finished rollouts alone, so a rebuilt or restored shard
holds exactly what the lost one did.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import time
import uuid
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ngramrl.config import DrafterConfig, NgramRLConfig
from ngramrl.core.batch import make_core
from ngramrl.core.history import RolloutHistory, checked_rollout
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


# An engine's copy of a prompt's window, as of a sync: (the shard's incarnation, the rollouts
# the shard had taken for the prompt).
Synced = tuple[str, int]
# What a sync answers for a prompt whose copy is behind: (rollouts taken, replace, rollouts to add
# as [epoch, tokens]); ``replace``: in place of the copy's (it is too old, or of another incarnation).
SyncUpdate = tuple[int, bool, list[list]]


def copies_held(core: Any, synced: dict[str, Synced], prompt_ids: list[str]) -> list[Synced | None]:
    """What an engine's ``core`` holds of each prompt's window, for ``DrafterShard.sync``: the
    sync it was last brought up to date by (``synced``), None where it holds no copy (never
    synced, or let go of by the core's token cap)."""
    return [synced.get(prompt_id) if core.rollout_count(prompt_id) else None for prompt_id in prompt_ids]


def apply_sync(core: Any, synced: dict[str, Synced], incarnation: str, prompts: dict[str, list[int]],
               updates: list[SyncUpdate | None]) -> int:
    """A sync's answer for ``prompts`` (id -> prompt tokens, in the order asked) enters the
    engine's ``core``, and ``synced`` records it; returns the prompts brought up to date."""
    updated = 0
    for (prompt_id, prompt), update in zip(prompts.items(), updates, strict=True):
        if update is None:
            continue
        taken, replace, rollouts = update
        if rollouts or replace:
            core.restore([[prompt_id, prompt, rollouts]], replace=replace)
        synced[prompt_id] = (incarnation, taken)
        updated += 1
    return updated


@dataclass
class ShardStats:
    rollouts: int = 0
    syncs: int = 0
    synced_prompts: int = 0   # prompts a sync sent rollouts of
    sync_us: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))


class DrafterShard:
    """The history of one shard of prompts (a Ray actor in the pipeline), on the same drafting
    core as the engines' proposers (``ngramrl.core.batch``), which copy its windows (``sync``)."""

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
        """No history: a new incarnation, so engines replace their copies of its windows."""
        self.core = make_core(self.config.history, self.drafter_config, self.config.prefetch, threads=1)
        self.incarnation = uuid.uuid4().hex
        self.taken: dict[str, int] = {}  # rollouts taken per prompt by this incarnation (restored ones too)
        self.visits: dict[str, int] = {}  # per prompt: its next epoch (``visit``)
        # Per prompt the token cap let go of (LRU), its taken count then: an engine's copy synced
        # up to that count holds a window this shard no longer has, so it is replaced, not extended.
        self.evicted_at: dict[str, int] = {}

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
            self.visits[prompt_id] = max(self.visits.get(prompt_id, 0), epoch + 1)
            self._note_eviction(prompt_id)
            self.core.add_rollout(prompt_id, prompt, output, epoch)
            self.taken[prompt_id] = self.taken.get(prompt_id, 0) + 1
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

    def visit(self, prompt_id: str) -> int:
        """The epoch of a new visit of the prompt (its samples generated now), one count for every
        engine: engines that feed the pool themselves (OpenRLHF's) see a prompt on whichever engine
        is free, and an engine's own count would lag the prompt's visits."""
        epoch = self.visits.get(prompt_id, 0)
        self.visits[prompt_id] = epoch + 1
        return epoch

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
        self.taken = {prompt_id: len(rollouts) for prompt_id, _, rollouts in prompts}
        self.visits = {prompt_id: 1 + max(epoch for epoch, _ in rollouts) for prompt_id, _, rollouts in prompts
                       if rollouts}
        beside = RolloutJournal(journal_path(path))  # what the shard that saved it took after the save
        if self.journal is None or os.path.abspath(beside.path) != os.path.abspath(self.journal.path):
            self._take(beside.read())
        self.replay_journal()
        return len(self.core)

    def _note_eviction(self, prompt_id: str) -> None:
        """Record it if the token cap let go of the prompt since it was taken: it holds no rollout
        here any more (a window keeps at least its newest rollout). Noticed where it matters, when
        the prompt comes back or is synced, so that an eviction costs nothing here."""
        if prompt_id in self.taken and not self.core.rollout_count(prompt_id):
            self.evicted_at[prompt_id] = self.taken[prompt_id]

    def _extends(self, prompt_id: str, copy: Synced | None) -> bool:
        """Whether an engine's ``copy`` of the prompt's window is this window's past, so the
        rollouts taken since, added in order, make it this window: it is of this incarnation and
        synced after the prompt's last eviction."""
        return copy is not None and copy[0] == self.incarnation and copy[1] > self.evicted_at.get(prompt_id, -1)

    # -- engines' copies ----------------------------------------------------------------------

    def sync(self, prompt_ids: list[str], copies: list[Synced | None]) -> tuple[str, list[SyncUpdate | None]]:
        """What an engine holding ``copies[i]`` of prompt ``prompt_ids[i]``'s window (as of an
        earlier sync; None: no copy) needs to hold the window this shard holds: None where it is
        up to date, else the rollouts it lacks, in the order taken (adding them trims its copy's
        window as this shard's was trimmed), or the whole window to replace its copy where the
        copy is of another incarnation of this shard, older than the window, or from before the
        token cap let go of the prompt. Returns this shard's incarnation with the updates."""
        begin = time.perf_counter()
        if len(copies) != len(prompt_ids):
            raise ValueError(f"sync: {len(copies)} copies for {len(prompt_ids)} prompts")
        for prompt_id in prompt_ids:
            self._note_eviction(prompt_id)
        behind = [i for i, (prompt_id, copy) in enumerate(zip(prompt_ids, copies, strict=True))
                  if not self._extends(prompt_id, copy) or copy[1] != self.taken.get(prompt_id, 0)]
        windows = {entry[0]: entry[2] for entry in self.core.export([prompt_ids[i] for i in behind])}
        updates: list[SyncUpdate | None] = [None] * len(prompt_ids)
        for i in behind:
            prompt_id, copy = prompt_ids[i], copies[i]
            taken, window = self.taken.get(prompt_id, 0), windows.get(prompt_id, [])
            if self._extends(prompt_id, copy) and 0 <= taken - copy[1] <= len(window):
                updates[i] = (taken, False, window[len(window) - (taken - copy[1]):])
            else:
                updates[i] = (taken, True, window)
            self.stats.synced_prompts += 1
        self.stats.syncs += 1
        self.stats.sync_us.append((time.perf_counter() - begin) * 1e6)
        return self.incarnation, updates

    def lookup(self, prompt_id: str, prompt: list[int], output: list[int], k: int) -> tuple[list[int], list[float]]:
        """The draft after ``output`` from the current history, changing nothing."""
        draft = self.core.lookup_context(prompt_id, prompt, output, k)
        return draft.tokens, draft.probs

    def health(self) -> dict[str, Any]:
        import statistics

        stats = self.stats
        return {"shard": self.index, "pid": os.getpid(), "prompts": len(self.core), "native": self.core.native,
                "stored_tokens": self.core.stored_tokens, "rollouts": stats.rollouts, "syncs": stats.syncs,
                "synced_prompts": stats.synced_prompts,
                "sync_us_median": statistics.median(stats.sync_us) if stats.sync_us else None}


@dataclass
class PoolSettings:
    """What the engines' proposers need to reach the pool (sent to them as JSON)."""

    names: list[str]
    namespace: str
    address: str | None = None
    sync_wait_ms: float = 20.0   # how long a step starting prompts waits for their windows (then: a later step)
    batch_sync_s: float = 60.0   # how long a generate call waits for its prompts' windows before its first step
    retry_after_s: float = 2.0

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> PoolSettings:
        return cls(**json.loads(text))


class ShardHandles:
    """The pool's shard actors as a client in another process reaches them: by name. The pool
    rebuilds a lost shard under its name, so a shard whose call failed (``failed``), or every
    shard (``look_up_all``), is looked up again at its next ``get``; while a name is missing, every
    ``retry_after_s``. ``reconnects``: the times a lookup found another actor than the one held."""

    def __init__(self, settings: PoolSettings, ray: Any) -> None:
        self.settings = settings
        self.ray = ray
        shards = len(settings.names)
        self.handles: list[Any | None] = [None] * shards
        self._look_up = [True] * shards
        self._retry_at = [0.0] * shards
        self.reconnects = 0

    def __len__(self) -> int:
        return len(self.handles)

    def get(self, shard: int) -> Any | None:
        """The shard's actor, None while its name is missing."""
        if not self._look_up[shard] or time.monotonic() < self._retry_at[shard]:
            return self.handles[shard]
        try:
            handle = self.ray.get_actor(self.settings.names[shard], namespace=self.settings.namespace)
        except (ValueError, self.ray.exceptions.RayError):  # not (yet) rebuilt by the pool, or Ray unreachable
            self.handles[shard] = None
            self._retry_at[shard] = time.monotonic() + self.settings.retry_after_s
            return None
        self._look_up[shard] = False
        if handle != self.handles[shard]:  # a new actor under the name (handles compare by actor id)
            self.handles[shard] = handle
            self.reconnects += 1
        return handle

    def failed(self, shard: int) -> None:
        """A call to the shard failed: the pool may have rebuilt it under its name."""
        self.handles[shard] = None
        self._look_up[shard] = True
        self._retry_at[shard] = 0.0

    def look_up_all(self) -> None:
        self._look_up = [True] * len(self.handles)
        self._retry_at = [0.0] * len(self.handles)


class DrafterPool:
    """The driver's handle on the shards: routing, saving, health checks and restarts."""

    def __init__(self, shards: int, config: NgramRLConfig, stop_tokens: tuple[int, ...], namespace: str,
                 snapshot_dir: str, name_prefix: str = "ngramrl", num_cpus: float = 0.25,
                 sync_wait_ms: float = 20.0) -> None:
        import ray

        self.ray = ray
        self.config = config
        self.stop_tokens = tuple(stop_tokens)
        self.namespace = namespace
        self.snapshot_dir = snapshot_dir
        self.names = [shard_name(name_prefix, i) for i in range(shards)]
        self.num_cpus = num_cpus
        self.sync_wait_ms = sync_wait_ms
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
        return PoolSettings(self.names, self.namespace, address, self.sync_wait_ms)

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
