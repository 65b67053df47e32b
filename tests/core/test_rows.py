"""The step's rows as arrays (``ngramrl.core.rows``): each helper from C++ and from its NumPy
reference, on random batches."""

import gc
import random

import numpy as np
import pytest

from ngramrl.core.drafter import Draft
from ngramrl.core.extension import native_module
from ngramrl.core.rows import DraftBatch, batch_ranks, committed_rows, recycled_lists

pytest.importorskip("ngramrl._native", reason="the native core is not built (pip install . builds it)")


@pytest.fixture(params=[False, True], ids=["python", "native"])
def native_path(request, monkeypatch) -> bool:
    """The C++ path of ngramrl.core.batch's array helpers (True) or their NumPy reference."""
    if not request.param:
        monkeypatch.setenv("NGRAMRL_NATIVE", "0")
    assert (native_module() is not None) == request.param
    return request.param


def test_draft_lists_give_each_row_its_draft_in_its_own_list(native_path):
    """vLLM's drafts: one list object per batch row (it trims them in place), the rows with a draft
    holding their tokens, the rest empty; the same from the C++ builder and the Python one."""
    rng = random.Random(5)
    drafts = []
    for _ in range(40):
        tokens = [rng.randrange(50_000) for _ in range(rng.randrange(0, 9))]
        drafts.append(Draft(tokens, [0.5] * len(tokens), 0, "prompt"))
    drafts.append(Draft([2**31 - 1, 7, 2**22], [0.5] * 3, 0, "prompt"))  # ids past any vocabulary too
    batch = DraftBatch.from_drafts(drafts)
    rows = [r for r in range(len(drafts)) if drafts[r].tokens]
    positions = rng.sample(range(100), len(rows))
    lists = batch.lists(100, positions, rows)
    assert len(lists) == 100 and len({id(x) for x in lists}) == 100
    expected = [[] for _ in range(100)]
    for position, row in zip(positions, rows, strict=True):
        expected[position] = drafts[row].tokens
    assert lists == expected and all(type(t) is int for x in lists for t in x)
    if native_path:  # lists of ints are no work for the cycle collector (vLLM holds them past the step)
        assert not any(gc.is_tracked(x) for x in lists)
    assert batch.lists(0, [], []) == []
    with pytest.raises(ValueError, match="position"):
        batch.lists(10, [10], [rows[0]])
    with pytest.raises(ValueError, match="row"):
        batch.lists(10, [0], [len(drafts)])
    with pytest.raises(ValueError, match="positions but"):
        batch.lists(10, [0, 1], [rows[0]])


def test_committed_rows_are_the_rows_with_a_prompt_and_tokens_in_arrival_order(native_path):
    """A vLLM step as arrays: the rows with an arrival rank and sampled tokens, ordered by rank,
    their tokens flat, their room for a draft, and the tokens accepted of last step's drafts
    (a row that was sent a draft committed its accepted tokens and one of the target's)."""
    rng = random.Random(6)
    for trial in range(30):
        n = rng.randrange(0, 60)
        sampled = [[rng.randrange(150_000) for _ in range(rng.randrange(0, 5))] for _ in range(n)]
        ranks = rng.sample(range(1000), n)
        arrival = np.array([-1 if rng.random() < 0.2 else r for r in ranks], dtype=np.int64)
        if trial % 3 == 0:  # a batch already in arrival order
            arrival = np.sort(arrival)
        num_tokens = np.array([rng.randrange(90, 101) for _ in range(n)], dtype=np.int32)
        sent_ranks = np.array(sorted(rng.sample(range(1000), rng.randrange(0, 40))), dtype=np.int64)
        sent_offsets = np.concatenate([[0], np.cumsum([rng.randrange(0, 4) for _ in sent_ranks])]).astype(np.int64)
        ends = np.array([rng.randrange(90, 110) for _ in range(n)], dtype=np.int64) if trial % 2 else None
        step = committed_rows(sampled, arrival, num_tokens, 100, 8, sent_ranks, sent_offsets, ends=ends)
        end = [100 if ends is None else min(100, int(ends[i])) for i in range(n)]
        index = sorted((i for i in range(n) if arrival[i] >= 0 and sampled[i]), key=lambda i: arrival[i])
        assert step.index.tolist() == index and step.ranks.tolist() == [arrival[i] for i in index]
        assert step.tokens.dtype == np.int32 and step.offsets.dtype == np.int64 and step.ks.dtype == np.int32
        assert [step.tokens[step.offsets[r]:step.offsets[r + 1]].tolist() for r in range(len(index))] == \
            [sampled[i] for i in index]
        assert step.ks.tolist() == [min(8, end[i] - int(num_tokens[i]) - 1) for i in index]
        assert step.with_room == sum(min(8, end[i] - int(num_tokens[i]) - 1) > 0 for i in index)
        sent = {int(r): int(sent_offsets[j + 1] - sent_offsets[j]) for j, r in enumerate(sent_ranks)}
        assert step.accepted == sum(len(sampled[i]) - 1 for i in index if sent.get(int(arrival[i]), 0) > 0)
        assert step.whole == (index == list(range(n)))
    none = np.zeros(0, dtype=np.int64)
    whole = committed_rows([[1], [2, 3]], np.array([4, 7]), [0, 0], 100, 8, none, np.zeros(1, dtype=np.int64))
    assert whole.whole and whole.tokens.tolist() == [1, 2, 3] and whole.accepted == 0
    rows_as_tuples = committed_rows([(1,), (2, 3)], np.array([7, 4]), [0, 0], 100, 8, none, np.zeros(1, dtype=np.int64))
    assert rows_as_tuples.index.tolist() == [1, 0] and rows_as_tuples.tokens.tolist() == [2, 3, 1]
    with pytest.raises(ValueError, match="arrival ranks"):
        committed_rows([[1]], np.array([0, 1]), [0, 0], 100, 8, none, np.zeros(1, dtype=np.int64))
    with pytest.raises(ValueError, match="sent offsets"):
        committed_rows([[1]], np.array([0]), [0], 100, 8, np.array([0]), np.zeros(1, dtype=np.int64))
    with pytest.raises(ValueError, match="must rise"):
        committed_rows([[1]], np.array([0]), [0], 100, 8, np.array([3, 3]), np.zeros(3, dtype=np.int64))
    with pytest.raises(ValueError, match="int32"):
        committed_rows([[1 << 40]], np.array([0]), [0], 100, 8, none, np.zeros(1, dtype=np.int64))


def test_committed_rows_take_the_tokens_of_steps_the_proposer_missed_from_the_engine(native_path):
    """A row that holds more tokens before this step's than it did at the last call (vLLM called
    no drafter in between) gets the tokens it missed from the engine's buffer, before its sampled
    ones; a row seen with as many (or fewer) tokens, or not seen last step, is as sampled."""
    rng = random.Random(7)
    for _ in range(30):
        n = rng.randrange(1, 50)
        sampled = [[rng.randrange(150_000) for _ in range(rng.randrange(0, 4))] for _ in range(n)]
        arrival = np.array(rng.sample(range(200), n), dtype=np.int64)
        num_tokens = np.array([rng.randrange(20, 60) for _ in range(n)], dtype=np.int64)
        buffer = np.array([[rng.randrange(150_000) for _ in range(64)] for _ in range(n)], dtype=np.int32)
        seen = sorted(rng.sample(range(n), rng.randrange(0, n + 1)), key=lambda i: arrival[i])
        then = {i: int(num_tokens[i]) - len(sampled[i]) - rng.choice([0, 0, 1, 3, -1]) for i in seen}
        sent_ranks = np.array([arrival[i] for i in seen], dtype=np.int64)
        sent_offsets = np.arange(len(seen) + 1, dtype=np.int64)
        step = committed_rows(sampled, arrival, num_tokens, 100, 8, sent_ranks, sent_offsets,
                              np.array([then[i] for i in seen], dtype=np.int64), token_ids=buffer)
        index = sorted((i for i in range(n) if sampled[i]), key=lambda i: arrival[i])
        expected, gaps = [], 0
        for i in index:
            before = int(num_tokens[i]) - len(sampled[i])
            missed = buffer[i, then[i]:before].tolist() if i in then and before > then[i] else []
            gaps += bool(missed)
            expected.append(missed + sampled[i])
        assert [step.tokens[step.offsets[r]:step.offsets[r + 1]].tolist() for r in range(len(index))] == expected
        assert step.gaps == gaps and step.num_tokens.tolist() == [int(num_tokens[i]) for i in index]
        assert step.gap_tokens == sum(len(tokens) for tokens in expected) - sum(len(sampled[i]) for i in index)
        counted = committed_rows(sampled, arrival, num_tokens, 100, 8, sent_ranks, sent_offsets,
                                 np.array([then[i] for i in seen], dtype=np.int64))  # no buffer: counted only
        assert counted.gaps == gaps and [counted.tokens[counted.offsets[r]:counted.offsets[r + 1]].tolist()
                                         for r in range(len(index))] == [sampled[i] for i in index]




def test_batch_ranks_look_up_only_the_ids_that_moved_and_name_those_that_left(native_path):
    """A vLLM step's request ids to arrival ranks, from the last step's: an id that is the same
    object at the same position keeps its last rank (no lookup); the others are looked up
    (``missing`` and listed where unknown); the last step's ids that are nowhere now have left.
    The batches change as vLLM changes them: finished rows removed, the last rows moved into their
    places, new and returning requests appended."""
    rng = random.Random(11)
    pool = [f"req-{i}" for i in range(400)]  # one object per id, as vLLM keeps them
    known: dict[str, int] = {}
    last: list[str] = []
    last_ranks = np.zeros(0, dtype=np.int64)
    for trial in range(60):
        now = [i for i in last if rng.random() > 0.1]
        holes = sorted(rng.sample(range(len(now) + 1), min(len(now) + 1, rng.randrange(0, 4))))
        for hole in holes:  # condense: the last row moves into a hole
            if hole < len(now) - 1:
                now[hole] = now.pop()
        now += [rng.choice(pool) for _ in range(rng.randrange(0, 6))]
        now = list(dict.fromkeys(now))
        batch = tuple(now) if trial % 2 else now
        ranks, misses, entered, left = batch_ranks(batch, known, -2, tuple(last), last_ranks)
        same = [i < len(last) and now[i] is last[i] for i in range(len(now))]
        assert entered == [i for i in range(len(now)) if not same[i]]
        assert misses == [i for i in entered if now[i] not in known]
        assert ranks.dtype == np.int64 and ranks.tolist() == [
            int(last_ranks[i]) if same[i] else known.get(now[i], -2) for i in range(len(now))]
        assert left == [i for i in last if i not in now]
        for i in misses:
            known[now[i]] = rng.choice([-1, len(known)])
            ranks[i] = known[now[i]]
        last, last_ranks = now, ranks
    kept, *_ = batch_ranks(("a", "b"), {"a": 5, "b": 6}, -2, ("a", "b"), np.array([1, 2]))
    assert kept.tolist() == [1, 2]  # the same objects at the same places: the last ranks, no lookup
    with pytest.raises((TypeError, ValueError)):  # a rank that is not an int
        batch_ranks(("a",), {"a": "not a rank"}, -2)
    with pytest.raises(ValueError, match="last ranks"):
        batch_ranks(("a",), {"a": 1}, -2, ("a", "b"), np.array([1]))

def test_for_target_gives_the_truncated_drafts_as_vllm_lists_and_counts_the_tokens_kept(native_path):
    rng = random.Random(8)
    drafts = []
    for _ in range(50):
        tokens = [1000 if rng.random() < 0.1 else rng.randrange(1000) for _ in range(rng.randrange(0, 9))]
        drafts.append(Draft(tokens, [rng.random() for _ in tokens], 2, "prompt"))
    batch = DraftBatch.from_drafts(drafts)
    lengths = [rng.randrange(-1, 11) for _ in drafts]
    positions = rng.sample(range(80), len(drafts))
    sent, lists, kept = batch.for_target(lengths, 1000, 80, positions)
    cut = batch.truncated(lengths, 1000)
    assert sent.tokens.tolist() == cut.tokens.tolist() and sent.offsets.tolist() == cut.offsets.tolist()
    assert sent.probs.tolist() == cut.probs.tolist() and sent.matched.tolist() == batch.matched.tolist()
    expected = [[] for _ in range(80)]
    for i, position in enumerate(positions):
        expected[position] = cut.draft(i).tokens
    assert lists == expected and len({id(x) for x in lists}) == 80
    assert kept == sum(max(0, min(n, len(d.tokens))) for d, n in zip(drafts, lengths, strict=True))
    assert kept > int(sent.offsets[-1])  # some tokens were cut at the vocabulary
    with pytest.raises(ValueError, match="positions"):
        batch.for_target(lengths, 1000, 80, positions[1:])
    with pytest.raises(ValueError, match="position"):
        batch.for_target(lengths, 1000, 10, positions)


def _random_batch(rng: random.Random, rows: int, longest: int) -> DraftBatch:
    drafts = []
    for _ in range(rows):
        tokens = [rng.randrange(300, 50_000) for _ in range(rng.randrange(0, longest + 1))]
        drafts.append(Draft(tokens, [0.5] * len(tokens), 1, "prompt"))
    return DraftBatch.from_drafts(drafts)


def _expected_lists(batch: DraftBatch, lengths: list[int], size: int, positions: list[int]) -> list[list[int]]:
    expected: list[list[int]] = [[] for _ in range(size)]
    for i, position in enumerate(positions):
        expected[position] = batch.draft(i).tokens[:max(0, lengths[i])]
    return expected


def test_recycled_lists_refill_only_the_lists_nobody_else_holds():
    """vLLM's lists made out of those handed out before (``recycled_lists``): a list that only the
    recycler holds is refilled with the new draft, whatever vLLM did to it (trimmed, grown); a list
    anyone else still holds is never touched; one holding anything but ints is let go of, not
    refilled; lists vLLM never lets go of are let go of after a few calls; every list is untracked
    by the cycle collector and holds the right tokens."""
    recycled = recycled_lists()
    rng = random.Random(11)
    size = 60
    kept: list[tuple[list[int], list[int]]] = []  # lists "vLLM" still holds, with their contents then
    in_vllm: list[tuple[list[int], list[int]]] = []  # the last call's lists: vLLM holds them until the next's
    for call in range(40):
        batch = _random_batch(rng, 40, 12)
        lengths = [rng.randrange(-1, 14) for _ in range(40)]
        positions = rng.sample(range(size), 40)
        _, lists, _ = batch.for_target(lengths, None, size, positions, recycled)
        assert lists == _expected_lists(batch, lengths, size, positions)
        assert len({id(x) for x in lists}) == size and not any(gc.is_tracked(x) for x in lists)
        for held, contents in kept + in_vllm:
            assert held == contents  # what someone else holds is never refilled
        for x in lists:  # what vLLM does with them: trims some, keeps some a while
            if x and rng.random() < 0.3:
                del x[rng.randrange(len(x)):]
            if call == 20 and rng.random() < 0.1:
                x.append("not a token")  # never refilled: freeing it may run code
            if rng.random() < 0.2:
                kept.append((x, list(x)))
        in_vllm = [(x, list(x)) for x in lists]
        del lists
    assert recycled.refilled > 30 * size  # most lists were refilled: the recycler is in use
    assert recycled.held <= 4 * size  # lists held elsewhere are let go of after a few calls
    recycled.release()
    assert recycled.held == 0


def test_truncated_keeps_each_rows_first_tokens_up_to_its_first_token_outside_the_vocabulary(native_path):
    """What goes to the target: row i's first lengths[i] tokens with their estimates, cut before
    the first token that is not an id of the vocabulary; the same from C++ and from numpy."""
    rng = random.Random(7)
    drafts = []
    for _ in range(60):
        tokens = [rng.choice([rng.randrange(1000), -1, 1000, 5000]) if rng.random() < 0.1 else rng.randrange(1000)
                  for _ in range(rng.randrange(0, 9))]
        drafts.append(Draft(tokens, [rng.random() for _ in tokens], 3, "global"))
    batch = DraftBatch.from_drafts(drafts)
    lengths = [rng.randrange(-1, 11) for _ in drafts]
    for vocab in (None, 1000):
        cut = batch.truncated(lengths, vocab)
        for i, (d, n) in enumerate(zip(drafts, lengths, strict=True)):
            end = max(0, min(n, len(d.tokens)))
            if vocab is not None:
                end = next((t for t in range(end) if not 0 <= d.tokens[t] < vocab), end)
            assert cut.draft(i) == Draft(d.tokens[:end], d.probs[:end], 3, "global"), (vocab, i)
    assert any(t >= 1000 or t < 0 for t in batch.truncated(lengths).tokens)
    assert batch.truncated([0] * len(drafts), 1000).tokens.size == 0
    with pytest.raises(ValueError, match="lengths for"):
        batch.truncated(lengths[1:])
