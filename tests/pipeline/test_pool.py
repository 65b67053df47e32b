"""The drafter pool: shard protocol, prefetch, saving, restoring and rebuilding after a crash."""

import os
import time

import pytest

from ngramrl.config import DrafterConfig, NgramRLConfig, PrefetchConfig
from ngramrl.core.batch import make_core
from ngramrl.core.trace import Rollout
from ngramrl.pipeline.pool import DrafterShard, SnapshotError, StepItem, shard_of

PROMPT = [1, 2, 3, 4]
REPEAT = [5, 6, 7, 8, 9, 10, 11, 12]


def shard_with_history(**prefetch):
    shard = DrafterShard(0, NgramRLConfig(prefetch=PrefetchConfig(**prefetch)), stop_tokens=(99,))
    shard.add_rollouts([("p", PROMPT, REPEAT + [99], 0), ("p", PROMPT, REPEAT + [99], 0),
                        ("p", PROMPT, REPEAT[:4] + [20, 21, 99], 0)])
    return shard


def test_shard_drafts_from_rollouts_and_live_siblings():
    shard = shard_with_history()
    first = shard.step([StepItem("r1", "p", [5], 4, prompt=PROMPT, before=[])], [])[0]
    assert first.tokens == [6, 7, 8, 9] and len(first.probs) == 4
    # A sibling's committed tokens are visible to the other request at once.
    shard.step([StepItem("r2", "p", [30], 4, prompt=PROMPT, before=[])], [])
    shard.step([StepItem("r2", "p", [31, 32, 33], 0)], [])
    reply = shard.step([StepItem("r1", "p", [6, 7], 4, verified=4), StepItem("r3", "p", [31], 4, prompt=PROMPT,
                                                                              before=[30])], [])
    assert reply[1].tokens[:2] == [32, 33]


def test_a_steps_new_requests_start_together_each_from_its_own_prompt():
    # Without the cross-prompt index a request drafts from its own prompt's history only.
    shard = DrafterShard(0, NgramRLConfig(drafter=DrafterConfig(use_global=False)), stop_tokens=(99,))
    shard.add_rollouts([("p", PROMPT, [5, 6, 7, 8, 99], 0), ("q", [7, 7], [5, 60, 61, 62, 99], 0)])
    items = [StepItem("a", "p", [5], 4, prompt=PROMPT, before=[]), StepItem("b", "q", [5], 4, prompt=[7, 7],
                                                                           before=[]),
             StepItem("c", "q", [60], 4, prompt=[7, 7], before=[5])]
    replies = shard.step(items, [])
    assert [reply.tokens for reply in replies] == [[6, 7, 8, 99], [60, 61, 62, 99], [61, 62, 99]]
    ending = [shard.requests["a"], shard.requests["b"]]
    shard.step([], ["a", "b"])  # both end in one call; c goes on
    for handle in ending:
        with pytest.raises(ValueError, match="not a live request"):
            shard.core.known(handle)
    assert shard.step([StepItem("c", "q", [61], 4)], [])[0].tokens == [62, 99]


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


def test_unknown_request_asks_for_its_prompt():
    shard = shard_with_history()
    reply = shard.step([StepItem("ghost", "p", [5], 4)], [])[0]
    assert not reply.known and reply.tokens == []


def test_prefetched_next_draft_equals_the_ordinary_one():
    shard, twin = shard_with_history(budget=8), shard_with_history(budget=8)
    for s in (shard, twin):
        s.step([StepItem("r", "p", [5], 4, prompt=PROMPT, before=[])], [])
    candidates = shard.prefetch(["r"], 4)["r"]
    assert candidates, "the shard predicted no outcome"
    j, b, tokens, _ = candidates[0]
    issued = shard.issued["r"].tokens
    outcome = issued[:j] + [b]
    hit = shard.step([StepItem("r", "p", outcome, 4, verified=len(issued), hit=True)], [])[0]
    ordinary = twin.step([StepItem("r", "p", outcome, 4, verified=len(issued))], [])[0]
    assert hit.tokens == tokens[:4] == ordinary.tokens


@pytest.mark.parametrize("native", [True, False])
def test_prefetch_guesses_from_the_part_of_the_draft_sent_and_from_no_draft(monkeypatch, native):
    """A request whose draft went to verification in part has outcomes up to that part only; one
    sent none of it (drafting off this step) has one thing to guess, its next token, and the
    draft prefetched for it is the ordinary one."""
    import ngramrl.pipeline.pool as pool

    monkeypatch.setattr(pool, "make_core", lambda *a, **k: make_core(*a, **k, native=native))
    shard, twin = shard_with_history(budget=8), shard_with_history(budget=8)
    for s in (shard, twin):
        s.step([StepItem("r", "p", [5], 4, prompt=PROMPT, before=[])], [])
    assert len(shard.issued["r"].tokens) == 4
    assert {j for j, *_ in shard.prefetch(["r"], 4, [2])["r"]} <= {0, 1, 2}
    for s in (shard, twin):
        s.step([StepItem("r", "p", [6, 30], 0, verified=2)], [])  # a step without a draft
    candidates = shard.prefetch(["r"], 4, [0])["r"]
    assert candidates and {j for j, *_ in candidates} == {0}
    _, b, tokens, _ = candidates[0]
    hit = shard.step([StepItem("r", "p", [b], 4, verified=0, hit=True)], [])[0]
    ordinary = twin.step([StepItem("r", "p", [b], 4, verified=0)], [])[0]
    assert hit.tokens == tokens[:4] == ordinary.tokens
    with pytest.raises(ValueError, match="1 verified lengths for 2 requests"):
        shard.prefetch(["r", "r"], 4, [0])


def test_finished_requests_leave_no_trace_once_rollouts_arrive():
    shard = shard_with_history()
    shard.step([StepItem("r", "p", [40, 41, 42], 4, prompt=PROMPT, before=[])], [])
    shard.step([], ["r"])
    clean = shard_with_history()
    for s in (shard, clean):
        s.add_rollouts([("p", PROMPT, [40, 41, 43, 99], 1)])
    assert shard.lookup("p", PROMPT, [40, 41], 4) == clean.lookup("p", PROMPT, [40, 41], 4)


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


def test_shard_latency_samples_are_bounded():
    from ngramrl.pipeline.pool import RECENT

    shard = shard_with_history(budget=2)
    shard.step([StepItem("r", "p", [5], 4, prompt=PROMPT, before=[])], [])
    for _ in range(RECENT + 10):
        shard.step([StepItem("r", "p", [], 0)], [])
        shard.prefetch(["r"], 4)
    assert len(shard.stats.step_us) == len(shard.stats.prefetch_us) == RECENT
    assert shard.health()["step_us_median"] is not None


def test_shard_of_is_stable_and_spreads():
    assert shard_of("gsm-0-1", 4) == shard_of("gsm-0-1", 4)
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


def test_the_engine_side_learns_acceptance_on_a_drafting_core_from_the_drafts_it_follows():
    """The pool's proposer keeps its calibration in a drafting core (native where built): a draft
    followed to its end is learned there, as the reference calibration learns it."""
    from ngramrl.core.drafter import Draft
    from ngramrl.core.outcome import AcceptanceCalibration, DraftFollower
    from ngramrl.pipeline.pool_proposer import CoreObserver

    core, reference = make_core(), AcceptanceCalibration(PrefetchConfig().prior_strength,
                                                          PrefetchConfig().calibration_decay)
    followers = [DraftFollower(CoreObserver(core)), DraftFollower(reference)]
    for follower in followers:
        for n in range(40):
            follower.offer("r", Draft([5, 6, 7], [0.9, 0.8, 0.7]))
            follower.committed("r", [5, 6, 40 + n])  # two of three accepted, every time
    assert sorted(map(tuple, core.calibration_state())) == sorted(map(tuple, reference.state()))
    chances = core.chances([0.9, 0.8, 0.7], [0, 3])
    assert chances[0] > 0.9 and chances[2] < 0.2  # learned: the first two pass, the third does not


def test_engine_side_drafts_end_at_the_engines_end_of_sequence_tokens():
    """Shards started without the tokenizer's EOS (OpenRLHF's launch) may draft past it; the engine
    side cuts there, and at k."""
    from types import SimpleNamespace

    from ngramrl.core.drafter import Draft
    from ngramrl.pipeline.pool_proposer import PoolSource

    source = SimpleNamespace(stop_tokens=frozenset({2}))
    draft = Draft([5, 6, 2, 7, 8], [0.9] * 5)
    assert PoolSource._usable(source, draft, 8).tokens == [5, 6, 2]
    assert PoolSource._usable(source, draft, 1).tokens == [5]
    assert PoolSource._usable(source, Draft([5, 6], [0.9, 0.9]), 8).tokens == [5, 6]
