"""An engine's rollouts to the drafter pool's shards (OpenRLHF's engines feed the pool): a shard
that died and was rebuilt under its name gets the rollouts its lost actor failed to take, and the
ones after them, through a new handle."""

from types import SimpleNamespace

from ngramrl.pipeline.feed import ShardFeed
from ngramrl.pipeline.pool import PoolSettings, shard_of
from tests.pipeline.test_pool import FakeRay, FakeRayError, FakeRef


class Shard:
    """A shard actor as the feed calls it; ``dead``: its calls fail in their replies, as Ray's do."""

    def __init__(self):
        self.taken, self.dead = [], False
        self.add_rollouts = SimpleNamespace(remote=self._add)

    def _add(self, records):
        if self.dead:
            return FakeRef(error=FakeRayError("the actor died"))
        self.taken.extend(records)
        return FakeRef()


def prompts_of(shard_index, shards, count):
    found = (f"p{i}" for i in range(10_000))
    return [p for p in found if shard_of(p, shards) == shard_index][:count]


def test_rollouts_a_lost_shard_failed_to_take_go_to_the_shard_rebuilt_under_its_name():
    ray = FakeRay()
    names = ["shard-0", "shard-1"]
    first, other = Shard(), Shard()
    ray.actors = {"shard-0": first, "shard-1": other}
    feed = ShardFeed(PoolSettings(names, "ns", retry_after_s=0.0), ray)
    a, b, c = prompts_of(0, 2, 3)
    feed.send(a, [1], [5, 2], 0)
    assert first.taken == [(a, [1], [5, 2], 0)]
    first.dead = True                       # the actor dies; its name goes with it
    del ray.actors["shard-0"]
    feed.send(b, [1], [6, 2], 0)            # through the handle held: fails in its reply
    feed.send(c, [1], [7, 2], 0)            # the reply read, the name looked up: none yet
    assert feed.waiting() == 2 and feed.stats.resent == 1
    rebuilt = Shard()
    ray.actors["shard-0"] = rebuilt         # the pool rebuilds it under its name
    d, = prompts_of(1, 2, 1)
    feed.send(d, [3], [8, 2], 1)            # any send flushes what waits
    assert rebuilt.taken == [(b, [1], [6, 2], 0), (c, [1], [7, 2], 0)]
    assert other.taken == [(d, [3], [8, 2], 1)]
    assert feed.waiting() == 0 and feed.stats.dropped == 0


def test_a_shard_down_for_long_keeps_only_its_latest_rollouts():
    ray = FakeRay()
    feed = ShardFeed(PoolSettings(["shard-0"], "ns", retry_after_s=0.0), ray, max_waiting=3)
    for epoch in range(5):
        feed.send("p", [1], [epoch, 2], epoch)
    assert feed.waiting() == 3 and feed.stats.dropped == 2
    shard = Shard()
    ray.actors["shard-0"] = shard
    feed.send("p", [1], [9, 2], 5)
    assert [record[3] for record in shard.taken] == [2, 3, 4, 5]
