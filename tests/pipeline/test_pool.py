"""The drafter pool: the engines' copies of its windows, saving, restoring and rebuilding after a crash."""

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from ngramrl.config import DrafterConfig, NgramRLConfig
from ngramrl.core.batch import make_core
from ngramrl.core.trace import Rollout
from ngramrl.pipeline.pool import DrafterShard, SnapshotError, shard_of

PROMPT = [1, 2, 3, 4]
REPEAT = [5, 6, 7, 8, 9, 10, 11, 12]


def shard_with_history():
    shard = DrafterShard(0, NgramRLConfig(), stop_tokens=(99,))
    shard.add_rollouts([("p", PROMPT, REPEAT + [99], 0), ("p", PROMPT, REPEAT + [99], 0),
                        ("p", PROMPT, REPEAT[:4] + [20, 21, 99], 0)])
    return shard


@pytest.mark.parametrize("bad, message", [
    (("q", [7], [5, -2], 0), r"rollouts\[1\] output\[1\] = -2 is negative"),
    (("q", [7], [5, 6], -1), r"rollouts\[1\] epoch must be an integer >= 0"),
    (("q", [7.5], [5, 6], 0), r"rollouts\[1\] prompt\[0\] is not an integer token id: 7.5"),
])
def test_a_call_with_a_bad_rollout_takes_and_journals_none_of_it(tmp_path, bad, message):
    """A bad rollout is refused with its place before anything is journaled: a journaled one
    would fail every rebuild of the shard from its journal."""
    journal = str(tmp_path / "shard.journal.jsonl")
    shard = DrafterShard(0, NgramRLConfig(), stop_tokens=(99,), journal=journal)
    shard.add_rollouts([("p", PROMPT, REPEAT + [99], 0)])
    with pytest.raises(ValueError, match=message):
        shard.add_rollouts([("p", PROMPT, REPEAT[:4] + [20, 99], 0), bad])
    assert shard.core.rollout_count("p") == 1 and shard.stats.rollouts == 1
    rebuilt = DrafterShard(0, NgramRLConfig(), stop_tokens=(99,), journal=journal)
    assert rebuilt.replay_journal() == 1 and rebuilt.core.export() == shard.core.export()


def test_a_shard_counts_each_prompts_visits_for_every_engine(tmp_path):
    """Engines that feed the pool themselves ask the prompt's shard for a visit's epoch: one count
    for every engine, going on from the epochs of the rollouts it holds, after a restart too."""
    shard = shard_with_history()  # three rollouts of "p" in epoch 0
    assert [shard.visit("p") for _ in range(3)] == [1, 2, 3]
    assert shard.visit("new") == 0
    shard.add_rollouts([("p", PROMPT, REPEAT, 7)])  # an epoch past the count (an engine's own, while it was down)
    assert shard.visit("p") == 8
    path = shard.save(str(tmp_path / "shard-0.json.gz"))
    restarted = DrafterShard(0, NgramRLConfig(), stop_tokens=(99,))
    restarted.load(path)
    assert restarted.visit("p") == 8  # from the rollouts it restored (visits without rollouts are not saved)


def test_snapshot_round_trip(tmp_path):
    shard = shard_with_history()
    shard.add_rollouts([("q", [9, 9], [1, 2, 3, 99], 2)])
    path = shard.save(str(tmp_path / "s.json.gz"))
    other = DrafterShard(0, NgramRLConfig(), stop_tokens=(99,))
    assert other.load(path) == 2
    for prompt_id, prompt, output in (("p", PROMPT, [5]), ("p", PROMPT, REPEAT[:4]), ("q", [9, 9], [1])):
        assert other.lookup(prompt_id, prompt, output, 6) == shard.lookup(prompt_id, prompt, output, 6)



def write_snapshot(path, data):
    import gzip
    import json

    with gzip.open(path, "wt") as handle:
        handle.write(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def owned_prompt(shard, shards):
    return next(f"q{i}" for i in range(100) if shard_of(f"q{i}", shards) == shard)


@pytest.mark.parametrize("content, message", [
    (b"not gzip", "not a readable drafter snapshot"),
    ("{truncated", "not a readable drafter snapshot"),
    ("[1, 2]", "not a drafter snapshot"),
    ({"version": 1, "shard": 0, "prompts": []}, "version 1"),
    ({"version": 2, "shard": 1, "shards": 2, "prompts": []}, "holds shard 1 of a pool of 2 shards; this is shard 0"),
    ({"version": 2, "shard": 0, "shards": 3, "prompts": []}, "holds shard 0 of a pool of 3 shards; this is shard 0"),
    ({"version": 2, "shard": 0, "shards": 2, "prompts": "x"}, "'prompts' is not a list"),
    ({"version": 2, "shard": 0, "shards": 2, "prompts": [[owned_prompt(1, 2), [1], []]]}, "belongs to shard 1"),
    ({"version": 2, "shard": 0, "shards": 2, "prompts": [[owned_prompt(0, 2), [1, -4], []]]}, "is negative"),
    ({"version": 2, "shard": 0, "shards": 2, "prompts": [[owned_prompt(0, 2), [1], [[0, ["a"]]]]]},
     "not an integer token id"),
])
def test_a_bad_snapshot_is_refused_naming_its_file_and_the_history_is_kept(tmp_path, content, message):
    shard = DrafterShard(0, NgramRLConfig(), stop_tokens=(99,), shards=2)
    shard.add_rollouts([("p", PROMPT, REPEAT + [99], 0)])
    before = shard.lookup("p", PROMPT, [5], 4)
    path = tmp_path / "shard-0.json.gz"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        write_snapshot(path, content)
    with pytest.raises(SnapshotError, match=message) as err:
        shard.load(str(path))
    assert str(err.value).startswith(f"{path}: ")
    assert shard.lookup("p", PROMPT, [5], 4) == before and before[0]


def test_a_snapshot_records_its_shard_and_shard_count(tmp_path):
    shard = DrafterShard(1, NgramRLConfig(), shards=3)
    prompt_id = owned_prompt(1, 3)
    shard.add_rollouts([(prompt_id, PROMPT, REPEAT, 0)])
    path = shard.save(str(tmp_path / "shard-1.json.gz"))
    assert DrafterShard(1, NgramRLConfig(), shards=3).load(path) == 1
    for index, shards in ((0, 3), (1, 2)):
        with pytest.raises(SnapshotError, match=f"holds shard 1 of a pool of 3 shards; this is shard {index}"):
            DrafterShard(index, NgramRLConfig(), shards=shards).load(path)


def test_shard_of_is_stable_and_spreads():
    """The driver, the engines and the shards each compute a prompt's shard in their own process:
    the answer may not depend on the process's string hashing."""
    code = "from ngramrl.pipeline.pool import shard_of; print([shard_of(f'gsm-0-{i}', 4) for i in range(32)])"
    answers = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                              capture_output=True, text=True, check=True).stdout for seed in ("1", "2", "3")}
    assert answers == {f"{[shard_of(f'gsm-0-{i}', 4) for i in range(32)]}\n"}
    assert len({shard_of(f"p{i}", 4) for i in range(64)}) == 4


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, namespace="ngramrl-test-pool")
    yield ray
    ray.shutdown()


def rollouts(epoch):
    out = []
    for i in range(6):
        prompt = [1, 100 + i, 3]
        for s in range(3):
            out.append(Rollout(f"p{i}", epoch, s, prompt, [10 + i, 11, 12 + s, 13, 14 + epoch, 99], "stop"))
    return out


def queries():
    return [(f"p{i}", [1, 100 + i, 3], out, 5) for i in range(6) for out in ([10 + i], [10 + i, 11], [13])]


def wait_down(pool, shards, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(pool.health(timeout_s=5.0)[index] is not None for index in shards):
        assert time.monotonic() < deadline, f"shards {shards} still answer after being killed"
        time.sleep(0.1)


def test_pool_rebuilds_a_killed_shard_and_restores_saved_state(local_ray, tmp_path):
    from ngramrl.pipeline.pool import DrafterPool

    pool = DrafterPool(3, NgramRLConfig(), (99,), namespace="ngramrl-test-pool", snapshot_dir=str(tmp_path / "pool"),
                       name_prefix="t1", num_cpus=0)
    try:
        bad = Rollout("p9", 0, 3, [1, 2], [5, -1])
        with pytest.raises(ValueError, match=r"rollout of prompt 'p9' \(epoch 0, sample 3\) output\[1\] = -1"):
            pool.add_rollouts([*rollouts(0), bad])  # refused before any is sent
        pool.add_rollouts(rollouts(0))
        pool.save()
        pool.add_rollouts(rollouts(1))  # after the save: replayed on a rebuild
        before = [pool.lookup(*q) for q in queries()]
        assert any(tokens for tokens, _ in before)
        local_ray.kill(pool.handles[1], no_restart=True)
        wait_down(pool, (1,))
        assert pool.heal() == [1] and pool.restarts == 1
        assert [pool.lookup(*q) for q in queries()] == before
        # OpenRLHF's engines feed the shards themselves, past the driver: the shard's own journal
        # still rebuilds it.
        direct = [(r.prompt_id, list(r.prompt), list(r.output), r.epoch) for r in rollouts(2)]
        local_ray.get([handle.add_rollouts.remote([record for record in direct
                                                   if shard_of(record[0], 3) == index])
                       for index, handle in enumerate(pool.handles)])
        fed = [pool.lookup(*q) for q in queries()]
        assert fed != before
        for index in (1, 2):
            local_ray.kill(pool.handles[index], no_restart=True)
        wait_down(pool, (1, 2))  # a kill is asynchronous: a shard may answer once more
        assert pool.heal() == [1, 2]
        assert [pool.lookup(*q) for q in queries()] == fed
        before = fed
        pool.save()
        fresh = DrafterPool(3, NgramRLConfig(), (99,), namespace="ngramrl-test-pool",
                            snapshot_dir=str(tmp_path / "other"), name_prefix="t2", num_cpus=0)
        try:
            fresh.restore(str(tmp_path / "pool"))
            assert [fresh.lookup(*q) for q in queries()] == before
            with pytest.raises(FileNotFoundError, match="no saved drafter shard"):
                fresh.restore(str(tmp_path / "nowhere"))
            # Damaged, swapped or from another shard count: refused naming the file, not a Ray traceback.
            swapped = tmp_path / "swapped"
            swapped.mkdir()
            for index in range(3):
                os.link(tmp_path / "pool" / f"shard-{(index + 1) % 3}.json.gz", swapped / f"shard-{index}.json.gz")
            with pytest.raises(SnapshotError, match=f"{swapped / 'shard-0.json.gz'}: holds shard 1 of a pool of 3"):
                fresh.restore(str(swapped))
            (swapped / "shard-1.json.gz").unlink()
            (swapped / "shard-1.json.gz").write_bytes(b"garbage")
            os.link(tmp_path / "pool" / "shard-0.json.gz", swapped / "shard-3.json.gz")
            with pytest.raises(SnapshotError, match="shard-3.json.gz: a snapshot of a pool of more shards"):
                fresh.restore(str(swapped))
            (swapped / "shard-3.json.gz").unlink()
            (swapped / "shard-0.json.gz").unlink()
            os.link(tmp_path / "pool" / "shard-0.json.gz", swapped / "shard-0.json.gz")
            with pytest.raises(SnapshotError, match=f"{swapped / 'shard-1.json.gz'}: not a readable drafter snap"):
                fresh.restore(str(swapped))
        finally:
            fresh.shutdown()
    finally:
        pool.shutdown()




def windows(core, prompt_ids):
    """The prompts' windows that hold rollouts, by prompt (an emptied one may keep its entry)."""
    return {prompt_id: (prompt, rollouts) for prompt_id, prompt, rollouts in core.export(prompt_ids) if rollouts}


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("shard_tokens", [8_000_000, 50])
def test_a_sync_brings_an_engines_copy_to_the_shards_window(monkeypatch, tmp_path, native, shard_tokens):
    """Whatever the shard took since, and whenever the engine syncs, its copy of a prompt's window
    comes out as the shard's: the rollouts it lacks added in order (the window trims as the
    shard's did), or the whole window in place of a copy older than the window, of another
    incarnation of the shard (restored from a snapshot), from before the shard's token cap
    (``shard_tokens``) let go of the prompt, or let go of by the engine's core."""
    import random
    from dataclasses import replace

    import ngramrl.pipeline.pool as pool
    from ngramrl.config import HistoryConfig
    from ngramrl.pipeline.pool import apply_sync, copies_held

    monkeypatch.setattr(pool, "make_core", lambda *a, **k: make_core(*a, **k, native=native))
    window = HistoryConfig(rollouts_per_prompt=3, epochs_kept=2)
    config = NgramRLConfig(history=replace(window, max_tokens=shard_tokens))
    shard = DrafterShard(0, config)
    engine, synced = make_core(window, native=native), {}
    prompts = {f"p{i}": [1, 50 + i, 3] for i in range(4)}
    rng = random.Random(7)
    epoch, replaced, added, evicted = 0, 0, 0, 0
    for n in range(400):
        roll = rng.random()
        if roll < 0.55:
            prompt_id = rng.choice(list(prompts))
            before = shard.core.counters()["evicted_prompts"]
            shard.add_rollouts([(prompt_id, prompts[prompt_id], [rng.randrange(5, 9) for _ in range(4)] + [99],
                                 epoch)])
            evicted += shard.core.counters()["evicted_prompts"] - before
            epoch += rng.random() < 0.15
        elif roll < 0.95:
            asked = rng.sample(list(prompts), rng.randrange(1, 4))
            incarnation, updates = shard.sync(asked, copies_held(engine, synced, asked))
            replaced += sum(1 for update in updates if update is not None and update[1])
            added += sum(1 for update in updates if update is not None and not update[1])
            apply_sync(engine, synced, incarnation, {p: prompts[p] for p in asked}, updates)
            assert windows(engine, asked) == windows(shard.core, asked), f"step {n}"
        elif roll < 0.98:
            restored = DrafterShard(0, config)
            restored.load(shard.save(str(tmp_path / "shard-0.json.gz")))
            assert restored.incarnation != shard.incarnation
            shard = restored
        else:
            engine.clear()  # as if the core's token cap had let go of every copy
    assert replaced > 10 and added > 10 and (evicted > 10) == (shard_tokens < 100)


def test_the_engine_drafts_from_its_copy_and_syncs_a_prompt_once_while_siblings_run(local_ray, tmp_path):
    """PoolSource on a real shard actor: a request's prompt is synced when it starts with no sibling
    running; the answer enters the engine's core at once where the step waits for it, else at a
    later step; a finished request is not history here until the driver has given it to the pool
    and a later start syncs it."""
    from ngramrl.pipeline.pool import DrafterPool
    from ngramrl.pipeline.pool_proposer import PoolSource

    pool = DrafterPool(1, NgramRLConfig(), (99,), namespace="ngramrl-test-pool", snapshot_dir=str(tmp_path / "pool"),
                       name_prefix="t3", num_cpus=0)
    try:
        pool.add_rollouts([Rollout("p", 0, s, PROMPT, REPEAT + [99], "stop") for s in range(2)])
        settings = pool.settings()
        settings.sync_wait_ms = 0  # the answer enters at a later step
        source = PoolSource(settings, NgramRLConfig(), DrafterConfig(stop_tokens=(99,)), 4, background=False)

        def settle():
            deadline = time.monotonic() + 30
            while source.syncs:
                assert time.monotonic() < deadline, "the sync did not come back"
                time.sleep(0.01)
                source.begin_step()

        first = source.start_many(["r1"], ["p"], [PROMPT], [[]])
        assert source.core.lookup_context("p", PROMPT, [5], 4).tokens == []  # nothing here yet
        settle()
        assert source.core.lookup_context("p", PROMPT, [5], 4).tokens == [6, 7, 8, 9]
        assert source.core.rollout_count("p") == 2
        sibling = source.start_many(["r2"], ["p"], [PROMPT], [[]])
        assert source.client.calls == 1 and not source.syncs  # a sibling runs: the copy is current
        source.finish_many(first + sibling, [0, 0])
        assert source.core.rollout_count("p") == 2  # finished here, history only through the pool
        pool.add_rollouts([Rollout("p", 1, 0, PROMPT, REPEAT[:3] + [40, 99], "stop")])
        settings.sync_wait_ms = 60_000  # the step starting the request waits for the answer
        third = source.start_many(["r3"], ["p"], [PROMPT], [[]])
        assert source.client.calls == 2 and source.client.synced_prompts == 2 and not source.syncs
        assert source.core.rollout_count("p") == 3
        assert source.core.lookup_context("p", PROMPT, [5, 6, 7], 2).tokens[:1] in ([8], [40])
        assert source.stats()["pool_sync_us_median"] > 0
        # A generate call that names its prompts syncs them before its first step; its requests
        # then start without a call, until the next generate call.
        source.finish_many(third, [1])
        pool.add_rollouts([Rollout("p", 2, 0, PROMPT, REPEAT[:2] + [41, 99], "stop"),
                           Rollout("q", 2, 0, [7, 7], REPEAT + [99], "stop")])
        source.finish_many(source.start_many(["r4"], ["p"], [PROMPT], [[]]), [0])  # a call without its prompts
        assert source.client.calls == 3 and source.core.rollout_count("p") == 4
        source.new_batch({"p": PROMPT, "q": [7, 7]})
        assert source.client.calls == 4 and source.core.rollout_count("q") == 1 and not source.syncs
        started = source.start_many(["r5", "r6"], ["q", "p"], [[7, 7], PROMPT], [[], []])
        source.finish_many(started, [0, 0])
        source.finish_many(source.start_many(["r7"], ["q"], [[7, 7]], [[]]), [0])
        assert source.client.calls == 4
        source.new_batch()
        source.start_many(["r8"], ["q"], [[7, 7]], [[]])
        assert source.client.calls == 5 and source.stats()["pool_batch_sync_us_median"] > 0
    finally:
        pool.shutdown()


class SlowShard(DrafterShard):
    """A shard whose syncs take ``delay_s`` (one that hangs, for as long as the test needs)."""

    delay_s = 3.0

    def sync(self, prompt_ids, copies):
        time.sleep(self.delay_s)
        return super().sync(prompt_ids, copies)


def test_a_generate_call_waits_for_a_hung_shard_only_so_long(local_ray):
    """A shard that does not answer delays a generate call's start by ``batch_sync_s`` at most; its
    prompts draft from the copy they have, and the answer enters the core at a later step."""
    from ngramrl.pipeline.pool import PoolSettings, shard_name
    from ngramrl.pipeline.pool_proposer import PoolSource

    name = shard_name("t4", 0)
    shard = local_ray.remote(num_cpus=0)(SlowShard).options(name=name, namespace="ngramrl-test-pool").remote(
        0, NgramRLConfig(), (99,))
    try:
        local_ray.get(shard.add_rollouts.remote([("p", PROMPT, REPEAT + [99], 0)]))
        settings = PoolSettings([name], "ngramrl-test-pool", batch_sync_s=0.3)
        source = PoolSource(settings, NgramRLConfig(), DrafterConfig(stop_tokens=(99,)), 4, background=False)
        begin = time.monotonic()
        source.new_batch({"p": PROMPT})
        assert time.monotonic() - begin < 2.0
        assert source.core.rollout_count("p") == 0 and "p" not in source.current and source.syncs
        source.start_many(["r1"], ["p"], [PROMPT], [[]])
        assert source.client.calls == 1  # the sync in flight is not asked again
        deadline = time.monotonic() + 30
        while source.syncs:
            assert time.monotonic() < deadline, "the late answer never came"
            time.sleep(0.05)
            source.begin_step()
        assert source.core.rollout_count("p") == 1 and source.client.late >= 1
    finally:
        local_ray.kill(shard, no_restart=True)


class FakeRayError(Exception):
    """Stands in for ``ray.exceptions.RayError``: a call to an actor that died."""


class FakeRef:
    def __init__(self, answer=None, error=None, ready=True):
        self.answer, self.error, self.ready = answer, error, ready


class FakeShardActor:
    """A shard actor as ``PoolSource`` calls it (``handle.sync.remote``), answering in this process:
    at once, only once ``release``d (a slow shard), or with a failure (``dead``: an actor that died)."""

    def __init__(self, shard, slow=False):
        self.shard, self.slow, self.dead = shard, slow, False
        self.refs = []
        self.sync = SimpleNamespace(remote=self._sync)

    def _sync(self, prompt_ids, copies):
        if self.dead:
            ref = FakeRef(error=FakeRayError("the actor died"))
        else:
            ref = FakeRef(answer=self.shard.sync(prompt_ids, copies), ready=not self.slow)
        self.refs.append(ref)
        return ref

    def release(self):
        for ref in self.refs:
            ref.ready = True


class FakeRay:
    """What ``PoolSource`` uses of Ray, over ``FakeShardActor``s registered by name."""

    exceptions = SimpleNamespace(RayError=FakeRayError)

    def __init__(self):
        self.actors = {}

    def get_actor(self, name, namespace=None):
        if name not in self.actors:
            raise ValueError(f"Failed to look up actor with name '{name}'")
        return self.actors[name]

    def wait(self, refs, num_returns, timeout):
        deadline = time.monotonic() + timeout
        while sum(ref.ready for ref in refs) < num_returns and time.monotonic() < deadline:
            time.sleep(0.001)
        return [ref for ref in refs if ref.ready], [ref for ref in refs if not ref.ready]

    def get(self, ref, timeout=None):
        if ref.error is not None:
            raise ref.error
        return ref.answer


@pytest.fixture
def fake_ray(monkeypatch):
    import ngramrl.pipeline.pool_proposer as pool_proposer

    ray = FakeRay()
    monkeypatch.setattr(pool_proposer, "connect_ray", lambda settings: ray)
    return ray


def fake_source(names, **settings):
    from ngramrl.pipeline.pool import PoolSettings
    from ngramrl.pipeline.pool_proposer import PoolSource

    return PoolSource(PoolSettings(names, "ngramrl-test-pool", **settings), NgramRLConfig(),
                      DrafterConfig(stop_tokens=(99,)), 4, background=False)


def test_a_generate_call_syncs_with_the_shard_the_pool_rebuilt_since_the_last_call(fake_ray):
    """The pool rebuilds a shard that died under its name between generate calls: the next call
    looks the name up again and syncs with the new actor, not through the handle to the lost one
    (whose failed sync would leave the call's prompts their old copies for the whole call)."""
    lost = FakeShardActor(shard_with_history())
    fake_ray.actors["s0"] = lost
    source = fake_source(["s0"])
    source.new_batch({"p": PROMPT})
    assert source.core.rollout_count("p") == 3 and source.shards.reconnects == 1
    lost.dead = True
    rebuilt = shard_with_history()
    rebuilt.add_rollouts([("p", PROMPT, REPEAT[:2] + [30, 99], 1)])
    fake_ray.actors["s0"] = FakeShardActor(rebuilt)
    source.new_batch({"p": PROMPT})
    assert source.client.errors == 0 and source.client.down_prompts == 0 and "p" in source.current
    assert windows(source.core, ["p"]) == windows(rebuilt.core, ["p"]) and source.shards.reconnects == 2
    source.new_batch({"p": PROMPT})  # the same actor under the name: looked up, not a reconnect
    assert source.client.calls == 3 and source.shards.reconnects == 2


def test_a_step_waits_for_its_own_syncs_not_for_a_slow_shards_earlier_one(fake_ray):
    """A step starting a prompt waits up to ``sync_wait_ms`` for the answer it asked for; an answer
    still out from a slow shard since an earlier step does not hold it up, and enters the core at
    the first step after it comes."""
    slow_prompt, fast_prompt = owned_prompt(0, 2), owned_prompt(1, 2)
    shards = [DrafterShard(index, NgramRLConfig(), (99,), shards=2) for index in range(2)]
    shards[0].add_rollouts([(slow_prompt, PROMPT, REPEAT + [99], 0)])
    shards[1].add_rollouts([(fast_prompt, PROMPT, REPEAT + [99], 0)])
    slow = FakeShardActor(shards[0], slow=True)
    fake_ray.actors.update(s0=slow, s1=FakeShardActor(shards[1]))
    source = fake_source(["s0", "s1"], sync_wait_ms=0)
    source.start_many(["r1"], [slow_prompt], [PROMPT], [[]])
    assert source.syncs and source.core.rollout_count(slow_prompt) == 0
    source.settings.sync_wait_ms = 5_000
    begin = time.monotonic()
    source.start_many(["r2"], [fast_prompt], [PROMPT], [[]])
    assert time.monotonic() - begin < 2.5
    assert source.core.rollout_count(fast_prompt) == 1 and source.core.rollout_count(slow_prompt) == 0
    slow.release()
    source.begin_step()
    assert source.core.rollout_count(slow_prompt) == 1 and not source.syncs and source.client.late == 1


@pytest.mark.parametrize("native", [True, False])
def test_a_copy_from_before_the_shards_cap_let_go_of_its_prompt_is_replaced(monkeypatch, native):
    """The shard's token cap lets go of a prompt (least recently used first) while engines hold
    copies of its window: the next sync makes each copy the shard's window (empty, or the rollouts
    taken since the prompt came back), never the old copy with the rollouts taken since."""
    import ngramrl.pipeline.pool as pool
    from ngramrl.config import HistoryConfig
    from ngramrl.pipeline.pool import apply_sync, copies_held

    monkeypatch.setattr(pool, "make_core", lambda *a, **k: make_core(*a, **k, native=native))
    shard = DrafterShard(0, NgramRLConfig(history=HistoryConfig(max_tokens=40)))
    engines = [(make_core(native=native), {}) for _ in range(2)]
    prompt = [1, 2, 3]

    def sync(engine, synced):
        incarnation, updates = shard.sync(["a"], copies_held(engine, synced, ["a"]))
        apply_sync(engine, synced, incarnation, {"a": prompt}, updates)
        return windows(engine, ["a"])

    shard.add_rollouts([("a", prompt, [10, 11, 12, 13, 99], 0), ("a", prompt, [10, 11, 14, 15, 99], 0)])
    for engine, synced in engines:
        assert sync(engine, synced) == windows(shard.core, ["a"]) and engine.rollout_count("a") == 2
    # 13 tokens of "a", then 31 of "b": over the cap of 40, "a" (the least recently used) goes
    shard.add_rollouts([("b", [4, 5, 6], [20 + i, 21, 22, 23, 24, 25, 99], 0) for i in range(4)])
    assert shard.core.rollout_count("a") == 0 and shard.core.rollout_count("b") == 4
    assert sync(*engines[0]) == {}  # the shard holds nothing of "a" now
    shard.add_rollouts([("a", prompt, [10, 11, 16, 17, 99], 1)])
    for engine, synced in engines:  # the first synced since the eviction, the second before it
        assert sync(engine, synced) == windows(shard.core, ["a"]) and engine.rollout_count("a") == 1


def ended_outputs_held(core, prompt_id):
    """Sequences in the prompt's index besides its prompt and its window: outputs of requests that
    ended there (the index is built first, as at a generate call's start)."""
    core.index_prompt(prompt_id)
    return core.index_shape(prompt_id)[2] - 1 - core.rollout_count(prompt_id)


@pytest.mark.parametrize("native", [True, False])
def test_an_engine_keeps_ended_outputs_only_for_the_prompts_of_its_generate_call(fake_ray, monkeypatch, native):
    """A request that ends leaves its output in its prompt's index for its siblings (the pool brings
    it back as a rollout at the prompt's next sync), where the engine's token cap does not count
    it. It stays while the generate call that named the prompt runs (a sibling may start after it
    ended) and through a next call that names the prompt again, and goes at the first call that
    does not: over many distinct prompts, never synced again, the engine holds only their windows."""
    import ngramrl.engine.sources as sources

    monkeypatch.setattr(sources, "make_core", lambda *a, **k: make_core(*a, **k, native=native))
    prompts = {f"p{i}": [1, 60 + i, 3] for i in range(12)}
    shard = DrafterShard(0, NgramRLConfig(), (99,))
    shard.add_rollouts([(prompt_id, prompt, [40, 41, 42, 99], 0) for prompt_id, prompt in prompts.items()])
    fake_ray.actors["s0"] = FakeShardActor(shard)
    source = fake_source(["s0"])
    for call in range(5):
        named = dict(list(prompts.items())[2 * call:2 * call + 3])  # the last one runs again next call
        source.new_batch(named)
        for prompt_id in source.core.prompt_ids():
            carried = call > 0 and prompt_id == f"p{2 * call}"  # the last call ran it too
            assert ended_outputs_held(source.core, prompt_id) == (2 if carried else 0), (call, prompt_id)
        for prompt_id, prompt in named.items():
            ended = source.start_many([f"{prompt_id}-{call}-0"], [prompt_id], [prompt], [REPEAT + [call, 99]])
            source.finish_many(ended, [call])
            # the prompt's one request ended; a sibling starting after it drafts from its output
            later = source.start_many([f"{prompt_id}-{call}-1"], [prompt_id], [prompt], [[]])
            assert source.client.calls == call + 1  # named: synced at the call's start, not now
            assert source.core.lookup_context(prompt_id, prompt, REPEAT[:3], 4).tokens == REPEAT[3:7]
            source.finish_many(later, [call])
        assert source.lingering == set(named)
    assert source.core.lookup_context("p10", prompts["p10"], REPEAT[:3], 4).tokens == REPEAT[3:7]
    source.new_batch({"p0": prompts["p0"]})
    assert source.core.lookup_context("p10", prompts["p10"], REPEAT[:3], 4).tokens == []
    assert sum(ended_outputs_held(source.core, prompt_id) for prompt_id in source.core.prompt_ids()) == 0
    assert not source.lingering


def test_a_prompt_no_generate_call_names_keeps_ended_outputs_while_a_sibling_runs(fake_ray):
    """Where the engine is given prompts one at a time (OpenRLHF's engines), a prompt's ended
    outputs serve its siblings still running; its last request takes them out (the next request
    of it syncs first, and the pool has them as rollouts by then)."""
    fake_ray.actors["s0"] = FakeShardActor(shard_with_history())
    source = fake_source(["s0"])
    first = source.start_many(["r1", "r2"], ["p", "p"], [PROMPT, PROMPT], [[30, 31, 32, 33, 34], []])
    source.finish_many(first[:1], [0])
    assert source.core.lookup_context("p", PROMPT, [30, 31], 3).tokens == [32, 33, 34]
    source.finish_many(first[1:], [0])
    assert source.core.lookup_context("p", PROMPT, [30, 31], 3).tokens == []
    assert ended_outputs_held(source.core, "p") == 0 and source.core.rollout_count("p") == 3
    assert not source.lingering


def test_ray_itself_failing_never_stops_a_generate_call(fake_ray):
    """Ray's own calls can fail with other errors than a dead actor's (its control service timing
    out, an RPC failing): the lookup of a shard, the wait for its answers. The engine's calls go
    on, the prompts drafting from what the copies hold, and the next call syncs again."""
    fake_ray.actors["s0"] = FakeShardActor(shard_with_history())
    source = fake_source(["s0"], retry_after_s=0.0)
    looked_up, waited = fake_ray.get_actor, fake_ray.wait

    def unreachable(*args, **kwargs):
        raise FakeRayError("the GCS did not answer in time")

    fake_ray.get_actor = unreachable
    source.new_batch({"p": PROMPT})  # the lookup fails: the shard counts as down for now
    assert source.client.down_prompts == 1 and source.core.rollout_count("p") == 0
    fake_ray.get_actor, fake_ray.wait = looked_up, unreachable
    source.new_batch({"p": PROMPT})  # the sync is sent; waiting for it fails
    source.begin_step()  # and so does looking for its answer at the next step
    assert source.client.errors == 3 and source.core.rollout_count("p") == 0  # the wait, its take, the step's
    fake_ray.wait = waited
    source.begin_step()  # Ray answers again: the answer that was out enters
    assert source.core.rollout_count("p") == 3
