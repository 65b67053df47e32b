"""The native drafting core and the Python reference give identical drafts, probabilities,
outcome predictions and history state, on random runs and on the shipped traces.

Each random run (a seed) draws its own configuration (windows, a token cap that evicts,
cross-prompt index on or off, stop tokens, confidence floors, the estimate's levels, chains chosen
from draft trees of several paths, global budgets) and its own
sequence of operations: rollouts added, requests started with and without registering their
prompt, steps with drafting rows and deferring rows, commits that follow the drafts (so prefetched
drafts are hit) and commits that do not, absorbs, prefetches, finishes with an epoch, without one,
and lingering. Both cores get the same calls; every result is compared exactly.
"""

from __future__ import annotations

import os
import random
import time

import numpy as np
import pytest

from ngramrl.bench.run import builtin_traces
from ngramrl.config import DrafterConfig, HistoryConfig, PrefetchConfig
from ngramrl.core.batch import (
    DraftBatch,
    OutcomeBatch,
    ReferenceCore,
    as_rows,
    make_core,
)
from ngramrl.core.extension import native_module
from ngramrl.core.trace import read_trace

native = pytest.importorskip("ngramrl._native", reason="the native core is not built (pip install . builds it)")


def pair(history: HistoryConfig, drafter: DrafterConfig, prefetch: PrefetchConfig, threads: int = 2,
         follow: bool = False):
    return (ReferenceCore(history, drafter, prefetch, follow=follow),
            make_core(history, drafter, prefetch, threads=threads, native=True, follow=follow))


def same_drafts(a: DraftBatch, b: DraftBatch, where: str) -> None:
    for name in ("tokens", "offsets", "probs", "matched", "source", "prefetched"):
        left, right = getattr(a, name), getattr(b, name)
        assert left.shape == right.shape and np.array_equal(left, right), f"{where}: {name} differ\n{left}\n{right}"


def same_outcomes(a: OutcomeBatch, b: OutcomeBatch, where: str) -> None:
    for name in ("rows", "accepted", "token", "probability"):
        left, right = getattr(a, name), getattr(b, name)
        assert np.array_equal(left, right), f"{where}: outcome {name} differ\n{left}\n{right}"
    same_drafts(a.drafts, b.drafts, f"{where} (prefetched drafts)")


def same_state(ref, nat, where: str) -> None:
    assert ref.stored_tokens == nat.stored_tokens, where
    assert ref.prompt_ids() == nat.prompt_ids(), f"{where}: LRU order"
    assert ref.counters() == nat.counters(), where
    assert ref.calibration_state() == nat.calibration_state(), where
    for prompt_id in [None, *ref.prompt_ids()]:
        assert ref.index_shape(prompt_id) == nat.index_shape(prompt_id), f"{where}: index of {prompt_id}"


def random_config(rng: random.Random) -> tuple[HistoryConfig, DrafterConfig, PrefetchConfig]:
    history = HistoryConfig(rollouts_per_prompt=rng.choice([2, 3, 8, 64]), epochs_kept=rng.choice([1, 2, 4]),
                            max_tokens=rng.choice([150, 400, 8_000_000]), prompt_tail=rng.choice([0, 2, 8]))
    drafter = DrafterConfig(max_draft=rng.choice([4, 8, 16]), min_confidence=rng.choice([0.0, 0.0, 0.05, 0.3]),
                            min_match=rng.choice([1, 1, 2]), rematch_tokens=rng.choice([3, 32]),
                            use_global=rng.random() < 0.7, stop_tokens=rng.choice([(), (3,)]),
                            levels=rng.choice([1, 2, 3, 5]), path_width=rng.choice([1, 1, 2, 4]))
    prefetch = PrefetchConfig(budget=rng.choice([0, 1, 4, 16]), global_budget=rng.choice([None, None, 5]),
                              min_probability=rng.choice([0.0, 0.01]), levels=rng.choice([1, 3]))
    return history, drafter, prefetch


def run_random(seed: int, steps: int = 60, threads: int = 2) -> dict[str, int]:
    rng = random.Random(seed)
    history, drafter, prefetch = random_config(rng)
    ref, nat = pair(history, drafter, prefetch, threads, follow=rng.random() < 0.5)
    vocab = rng.choice([6, 12, 40])
    prompts = {f"p{i}": [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))] for i in range(rng.randrange(1, 6))}

    def sample(n: int, base: list[int] | None = None) -> list[int]:
        if base and rng.random() < 0.6:  # copy a stretch of an earlier sequence: drafts get accepted
            start = rng.randrange(len(base))
            return (base[start:] + [rng.randrange(vocab) for _ in range(n)])[:n]
        return [rng.randrange(vocab) for _ in range(n)]

    outputs: list[list[int]] = []
    for epoch in range(rng.randrange(0, 3)):
        for pid, prompt in prompts.items():
            for _ in range(rng.randrange(0, 4)):
                out = sample(rng.randrange(0, 40), rng.choice(outputs) if outputs else None)
                outputs.append(out)
                ref.add_rollout(pid, prompt, out, epoch)
                nat.add_rollout(pid, prompt, out, epoch)
    same_state(ref, nat, "after the warm rollouts")
    live: dict[int, tuple[str, list[int]]] = {}  # handle -> (prompt id, its tokens so far)
    last: dict[int, tuple[list[int], list[float]]] = {}
    predicted: dict[int, list[list[int]]] = {}  # handle -> commits the last prefetch looked up
    epoch = 3
    counts = {"hits": 0, "drafted": 0, "outcomes": 0, "replaced": 0}
    for step in range(steps):
        starting = []  # the step's admissions, started in one call (siblings among them)
        while len(live) + len(starting) < rng.randrange(1, 9):
            pid = rng.choice(list(prompts) + ["unseen"])
            starting.append((pid, prompts.get(pid, [1, 2]), sample(rng.randrange(0, 4))))
        if starting:
            register = rng.random() < 0.5
            pids, prompts_in, befores = (list(column) for column in zip(*starting, strict=True))
            handles = ref.start_many(pids, prompts_in, befores, register)
            assert nat.start_many(pids, [np.array(p) if rng.random() < 0.3 else p for p in prompts_in],
                                  befores, register) == handles
            for h, (pid, _, before) in zip(handles, starting, strict=True):
                assert ref.known(h) == nat.known(h)
                live[h] = (pid, list(before))
        handles = list(live)
        rng.shuffle(handles)
        committed, ks = [], []
        for h in handles:
            draft = last.get(h, ([], []))[0]
            accept = rng.randrange(len(draft) + 1) if draft else 0
            if predicted.get(h) and rng.random() < 0.5:
                tokens = rng.choice(predicted[h])  # an outcome the prefetch looked up
            elif draft and rng.random() < 0.5:
                tokens = draft[:accept] + [rng.randrange(vocab)]  # as verification commits
            else:
                tokens = sample(rng.randrange(0, 4), outputs[rng.randrange(len(outputs))] if outputs else None)
            committed.append(tokens)
            ks.append(0 if rng.random() < 0.2 else rng.choice([1, drafter.max_draft]))
            live[h][1].extend(tokens)
        predicted = {}
        offsets = np.cumsum([0] + [len(t) for t in committed])
        flat = [t for tokens in committed for t in tokens]
        where = f"seed {seed} step {step}"
        a = ref.step(handles, flat, offsets, ks)
        b = nat.step(handles, flat, offsets, ks)
        same_drafts(a, b, where)
        assert a.drafts() == b.drafts() == [a.draft(i) for i in range(len(a))], where
        cut = [rng.randrange(5) for _ in handles]
        assert [d.tokens for d in a.truncated(cut).drafts()] == [d.tokens[:n] for d, n in
                                                                 zip(a.drafts(), cut, strict=True)], where
        counts["hits"] += int(a.prefetched.sum())
        counts["drafted"] += int(len(a.tokens))
        for i, h in enumerate(handles):
            d = a.draft(i)
            last[h] = (d.tokens, d.probs)
        if rng.random() < 0.5:
            verified = [rng.randrange(len(last[h][0]) + 1) for h in handles]
            probs = [p for h, n in zip(handles, verified, strict=True) for p in last[h][1][:n]]
            voff = np.cumsum([0] + verified)
            accepted = [rng.randrange(n + 1) for n in verified]
            ref.observe(probs, voff, accepted)
            nat.observe(probs, voff, accepted)
            assert np.array_equal(ref.chances(probs, voff), nat.chances(probs, voff)), where
        if rng.random() < 0.5:  # the cost model's choice of draft lengths, on the calibration both learned
            # (base, per request, per token, per verify, knee): without a plateau, and with one that
            # holds some of the batch's draft tokens (a GPU's memory-bound forward)
            fit = rng.choice([(0.03, 0.001, 0.0, 0.0, 0), (0.03, 0.001, 0.001, 0.0, 0), (9e-5, 0.003, 0.002, 3e-5, 0),
                              (0.02, 0.0002, 1e-5, 0.0, 0), (0.02, 0.0002, 1e-3, 1e-4, len(handles) + 3),
                              (0.02, 0.0002, 1e-3, 0.0, 2 * len(handles))])
            args = (a.probs, a.offsets, rng.choice([1.0, 0.7]), fit, rng.choice([0.0, 0.1]),
                    rng.random() < 0.8, rng.choice([0, 1, 4]))
            left, right = ref.lengths(*args), nat.lengths(*args)
            assert np.array_equal(left[0], right[0]) and left[1:] == right[1:], f"{where}: lengths {left} {right}"
        if rng.random() < 0.85:
            absorbed = [h for h in handles if rng.random() < 0.9]
            now = rng.random() < 0.5
            ref.absorb(absorbed, now=now)
            nat.absorb(absorbed, now=now)
        if rng.random() < 0.1:  # the engine's source moves the budget with the forward's length
            budget = rng.choice([0, 1, 4, 16, 32])
            ref.set_budget(budget)
            nat.set_budget(budget)
        if rng.random() < 0.8:
            sent = [h for h in handles if rng.random() < 0.9]
            cut = {h: rng.randrange(len(last[h][0]) + 1) for h in sent}
            ptoks = [t for h in sent for t in last[h][0][:cut[h]]]
            pprobs = [p for h in sent for p in last[h][1][:cut[h]]]
            poff = np.cumsum([0] + [cut[h] for h in sent])
            ref.prefetch(sent, ptoks, poff, pprobs, drafter.max_draft)
            nat.prefetch(sent, ptoks, poff, pprobs, drafter.max_draft)
            got = nat.collect()
            same_outcomes(ref.collect(), got, where)
            counts["outcomes"] += len(got)
            for row, j, b in zip(got.rows.tolist(), got.accepted.tolist(), got.token.tolist(), strict=True):
                predicted.setdefault(sent[row], []).append(last[sent[row]][0][:j] + [b])
        ending: dict[str, list[int]] = {}  # each way of ending, its requests in one call
        for h in list(live):
            if rng.random() < 0.12:
                ending.setdefault(rng.choice(["epoch", "drop", "linger"]), []).append(h)
        for how, hs in ending.items():
            rng.shuffle(hs)
            epochs = [epoch + rng.randrange(2) for _ in hs] if how == "epoch" else None
            if len(hs) == 1 and rng.random() < 0.5:
                ref.finish(hs[0], None if epochs is None else epochs[0], how == "linger")
                nat.finish(hs[0], None if epochs is None else epochs[0], how == "linger")
            else:
                ref.finish_many(hs, epochs, how == "linger")
                nat.finish_many(hs, epochs, how == "linger")
            for h in hs:
                del live[h]
                last.pop(h, None)
            if how == "epoch" and rng.random() < 0.3:
                epoch += 2
        if rng.random() < 0.1:  # a drafter pool's engine copy lets go of the outputs that ended lingering
            dropped = rng.sample(list(prompts) + ["unseen"], rng.randrange(1, min(4, len(prompts) + 2)))
            ref.drop_ended(dropped)
            nat.drop_ended(dropped)
        if rng.random() < 0.1:
            pid = rng.choice(list(prompts))
            out = sample(rng.randrange(1, 30), rng.choice(outputs) if outputs else None)
            ref.add_rollout(pid, prompts[pid], out, epoch)
            nat.add_rollout(pid, prompts[pid], out, epoch)
        if rng.random() < 0.08:  # a drafter pool's sync: rollouts added, or a window in place of the prompt's
            pid = rng.choice(list(prompts))
            window = [[max(0, epoch - rng.randrange(2)), sample(rng.randrange(1, 20), rng.choice(outputs) if outputs
                                                                else None)] for _ in range(rng.randrange(0, 4))]
            replace = rng.random() < 0.7
            ref.restore([[pid, prompts[pid], window]], replace=replace)
            nat.restore([[pid, prompts[pid], window]], replace=replace)
            assert ref.export([pid, "unseen"]) == nat.export([pid, "unseen"]), where
            counts["replaced"] += replace
        same_state(ref, nat, where)
        if rng.random() < 0.1:
            pid = rng.choice(list(prompts) + ["unseen"])
            context = sample(rng.randrange(0, 10))
            assert ref.lookup_context(pid, prompts.get(pid, []), context, 8) == \
                nat.lookup_context(pid, prompts.get(pid, []), context, 8), where
    assert ref.export() == nat.export()
    assert ref.followed() == nat.followed()
    return counts


@pytest.mark.parametrize("seed", range(120))
def test_native_equals_reference_on_random_runs(seed):
    run_random(seed)


def test_random_runs_exercise_what_they_compare():
    """The random runs draft, prefetch, hit prefetched drafts and replace windows (else they would
    compare little)."""
    totals = {"hits": 0, "drafted": 0, "outcomes": 0, "replaced": 0}
    for seed in range(30):
        for key, value in run_random(seed, steps=30).items():
            totals[key] += value
    assert totals["drafted"] > 1000 and totals["outcomes"] > 500 and totals["hits"] > 50, totals
    assert totals["replaced"] > 20, totals


@pytest.mark.parametrize("threads", [1, 3])
def test_thread_count_does_not_change_results(threads):
    for seed in (1, 7, 11):
        run_random(seed, steps=40, threads=threads)


def test_export_restore_round_trip_gives_the_same_drafts():
    rng = random.Random(5)
    history, drafter, prefetch = HistoryConfig(prompt_tail=2), DrafterConfig(), PrefetchConfig()
    ref, nat = pair(history, drafter, prefetch)
    for epoch in range(3):
        for p in range(4):
            out = [rng.randrange(8) for _ in range(30)]
            ref.add_rollout(f"p{p}", [1, 2, 3], out, epoch)
            nat.add_rollout(f"p{p}", [1, 2, 3], out, epoch)
    restored = make_core(history, drafter, prefetch, native=True)
    restored.restore(ref.export())
    assert restored.export() == nat.export() == ref.export()
    drafts = []
    for core in (nat, restored):
        h = core.start("p1", [1, 2, 3], [4, 5])
        drafts.append(core.step([h], [6], [0, 1], [8]).draft(0))
    assert drafts[0] == drafts[1] and drafts[0].tokens


def test_bad_input_is_rejected_with_what_is_wrong():
    ref, nat = pair(HistoryConfig(), DrafterConfig(), PrefetchConfig())
    for core in (ref, nat):
        h = core.start("p", [1, 2], register=True)
        with pytest.raises(ValueError, match="not a live request"):
            core.step([h + 7], [1], [0, 1], [4])
        with pytest.raises(ValueError, match="appears twice"):
            core.step([h, h], [1, 2], [0, 1, 2], [4, 4])
        with pytest.raises(ValueError, match="offsets"):
            core.step([h], [1, 2], [0, 1], [4])
        core.finish(h)
        with pytest.raises(ValueError, match="not a live request"):
            core.finish(h)
    with pytest.raises(ValueError, match="ks has"):
        as_rows([1], [1], [0, 1], [1, 2])


def test_a_batch_of_requests_with_bad_input_starts_or_ends_none_of_them():
    """start_many and finish_many check every request first: the error names the request and
    the position, and nothing has started or ended."""
    ref, nat = pair(HistoryConfig(prompt_tail=0), DrafterConfig(use_global=False), PrefetchConfig())
    for core in (ref, nat):
        core.add_rollout("p", [9], [1, 2, 3, 4], 0)
        first = core.start_many(["p", "p"], [[9], [9]], [[], [1]], register=True)
        assert first == [0, 1]
        stored = core.stored_tokens
        for prompts, outputs, message in (
                ([[9], [9], [9, -3]], [[], [], []], r"prompts\[2\]\[1\] = -3 is negative"),
                ([[9], [9], [9]], [[], [1, "x"], []], r"outputs\[1\]\[1\] is not an integer token id: 'x'"),
                ([[9], [9], [9]], [[], [True], []], r"outputs\[1\]\[0\] is not a token id: True"),
                ([[9], 7, [9]], [[], [], []], r"prompts\[1\] must be a sequence of token ids"),
                ([[9], [9], np.array([9.0, 2.5])], [[], [], []], r"prompts\[2\]"),
                ([[9], [9]], [[], [], []], "start got 3 prompt ids, 2 prompts and 3 outputs")):
            with pytest.raises(ValueError, match=message):
                core.start_many(["p", "p", "p"], prompts, outputs, register=True)
        assert core.stored_tokens == stored
        assert core.start("p", [9], [2], register=True) == 2  # no handle was taken by a failed call
        for handles, epochs, message in (([0, 9], [1, 1], "request handle 9 is not a live request"),
                                         ([0, 1, 0], [1, 1, 1], "request handle 0 is finished twice"),
                                         ([0, 1], [1, -1], "epoch must be >= 0"),
                                         ([0, 1], [1], "finish got 1 epochs for 2 requests")):
            with pytest.raises(ValueError, match=message):
                core.finish_many(handles, epochs)
        assert all(core.known(h) for h in (0, 1, 2))
        core.finish_many([2, 0], [1, 1])
        assert core.known(1)
        with pytest.raises(ValueError, match="not a live request"):
            core.known(0)
    assert ref.export() == nat.export()


@pytest.mark.parametrize("bad, message", [
    ([3, -1], r"output\[1\] = -1 is negative"),
    ([3, 2**31], r"output\[1\] = 2147483648 is not a 32-bit token id"),
    ([3, 2.5], r"output\[1\] is not an integer token id: 2.5"),
    ([[3, 4]], r"output\[0\] is not an integer token id: \[3, 4\]"),
    (np.array([3.0, 4.0]), r"output"),
    (np.array([True]), r"output"),
    ("34", r"output must be a sequence of token ids"),
])
def test_a_rollout_or_context_with_bad_tokens_is_refused_and_nothing_is_stored(bad, message):
    """add_rollout and lookup_context take the same token ids as start: a float array is refused
    (it was cast, 2.5 -> 2), a value out of 32 bits named, and a refused rollout stores nothing."""
    ref, nat = pair(HistoryConfig(prompt_tail=0), DrafterConfig(use_global=False), PrefetchConfig())
    for core in (ref, nat):
        core.add_rollout("p", [9], [1, 2, 3, 4], 0)
        stored = core.stored_tokens
        with pytest.raises(ValueError, match=message):
            core.add_rollout("p", [9], bad, 1)
        with pytest.raises(ValueError, match=message.replace("output", "prompt")):
            core.add_rollout("q", bad, [1, 2], 1)
        with pytest.raises(ValueError, match=message):
            core.lookup_context("p", [9], bad, 4)
        with pytest.raises(ValueError, match="epoch must be an integer >= 0"):
            core.add_rollout("p", [9], [1], -1)
        assert core.stored_tokens == stored and core.rollout_count("p") == 1 and core.rollout_count("q") == 0
        assert core.lookup_context("p", np.array([9], dtype=np.uint16), (1, 2), 4).tokens == [3, 4]
    assert ref.export() == nat.export()


def test_prefetched_draft_is_the_synchronous_one_and_is_dropped_when_an_index_changes():
    for core in pair(HistoryConfig(prompt_tail=0), DrafterConfig(use_global=False), PrefetchConfig(budget=4)):
        core.add_rollout("p", [9], [1, 2, 3, 4, 5, 6], 0)
        core.add_rollout("p", [9], [1, 2, 7, 8, 5, 6], 0)
        h = core.start("p", [9], [])
        first = core.step([h], [1], [0, 1], [4])
        core.absorb([h])
        core.prefetch([h], first.tokens, first.offsets, first.probs, 4)
        outcomes = core.collect()
        assert len(outcomes) > 0
        j, b = int(outcomes.accepted[0]), int(outcomes.token[0])
        committed = first.draft(0).tokens[:j] + [b]
        twin = core.start("p", [9], [1])  # changes the prompt's index: the prefetched drafts are stale
        hit = core.step([h, twin], committed, [0, len(committed), len(committed)], [4, 0])
        assert not hit.prefetched[0]
        core.finish(twin)
        core.absorb([h])
        second = core.step([h], [], [0, 0], [4])  # no tokens: plain lookup to move on
        core.absorb([h])
        core.prefetch([h], second.tokens, second.offsets, second.probs, 4)
        outcomes = core.collect()
        if not len(outcomes):
            continue
        j, b = int(outcomes.accepted[0]), int(outcomes.token[0])
        committed = second.draft(0).tokens[:j] + [b]
        hit = core.step([h], committed, [0, len(committed)], [4])
        assert hit.prefetched[0]
        assert hit.draft(0).tokens == outcomes.drafts.draft(0).tokens[:4]


def run_with_a_window_moving_on(core, before_prefetch: bool) -> tuple[list[bool], set[int]]:
    """Requests of prompts p and q step twice, each step's next drafts prefetched; between the
    steps another request of q finishes in a new epoch, which moves q's window on (its epoch-0
    rollout leaves, its index is rebuilt): before the first step's prefetch, or after it. Returns
    which rows the second step found prefetched, and the rows its own prefetch covered."""
    core.add_rollout("p", [9], [1, 2, 3, 4, 5, 6, 1, 2, 7, 8], 0)
    core.add_rollout("q", [8], [1, 2, 3, 4, 5, 6, 1, 2, 7, 8], 0)
    h, g = core.start("p", [9], []), core.start("q", [8], [])
    leaving = core.start("q", [8], [5, 5])
    first = core.step([h, g], [1, 1], [0, 1, 2], [4, 4])
    if before_prefetch:
        core.finish(leaving, epoch=1)
    core.prefetch([h, g], first.tokens, first.offsets, first.probs, 4, absorb=[h, g])
    outcomes = outcomes_by_row(core.collect())
    assert set(outcomes) == {0, 1}, type(core).__name__
    if not before_prefetch:
        core.finish(leaving, epoch=1)
    commits = [first.draft(row).tokens[:outcomes[row][0][0]] + [outcomes[row][0][1]] for row in (0, 1)]
    second = core.step([h, g], commits[0] + commits[1], [0, len(commits[0]), len(commits[0]) + len(commits[1])],
                       [4, 4])
    core.prefetch([h, g], second.tokens, second.offsets, second.probs, 4, absorb=[h, g])
    return second.prefetched.tolist(), set(outcomes_by_row(core.collect()))


def test_a_prompts_window_moving_on_drops_only_its_own_requests_prefetched_drafts():
    """In RL every prompt's window moves on once an epoch (its first finished rollout of the new
    epoch evicts the oldest epoch's): that prompt's index is rebuilt, and its requests' prefetched
    drafts are stale, but other prompts' requests keep theirs and stay readable for the prefetch."""
    for core in pair(HistoryConfig(prompt_tail=0, epochs_kept=1), DrafterConfig(use_global=False),
                     PrefetchConfig(budget=4)):
        assert run_with_a_window_moving_on(core, before_prefetch=False) == ([True, False], {0, 1}), \
            type(core).__name__


def test_a_request_whose_prompts_window_moved_on_during_a_step_is_prefetched_from_the_new_index():
    """A request's committed tokens entering its prompt's index also hand it the index that was
    rebuilt meanwhile: the prefetch of the step in which its prompt's window moved on already
    covers it, and the next step takes its prefetched draft."""
    for core in pair(HistoryConfig(prompt_tail=0, epochs_kept=1), DrafterConfig(use_global=False),
                     PrefetchConfig(budget=4)):
        assert run_with_a_window_moving_on(core, before_prefetch=True) == ([True, True], {0, 1}), \
            type(core).__name__


def test_a_stopped_prefetch_leaves_its_drafts_to_the_next_step():
    """``stop`` (what the engine calls when the forward ends) waits for the prefetch without
    handing its outcomes over; the next step still finds them."""
    for core in pair(HistoryConfig(prompt_tail=0), DrafterConfig(use_global=False), PrefetchConfig(budget=16)):
        core.add_rollout("p", [9], [1, 2, 3, 4, 5, 6, 1, 2, 7, 8], 0)
        h = core.start("p", [9], [])
        first = core.step([h], [1], [0, 1], [4])
        core.prefetch([h], first.tokens, first.offsets, first.probs, 4, absorb=[h])
        core.stop(cancel=False)
        assert first.draft(0).tokens == [2, 7, 8]  # from the latest "1"
        committed = [2, 3]  # the likeliest outcome: 2 accepted, then 3 (what followed "1 2" first)
        assert core.step([h], committed, [0, len(committed)], [4]).prefetched[0]


def test_a_cancelling_stop_reports_the_prefetchs_span_once():
    """The engine's source sets the next budget from the time the last prefetch had: what it chose,
    what it looked up, how long its work took and how long it had until the stop."""
    core = make_core(HistoryConfig(prompt_tail=0), DrafterConfig(use_global=False), PrefetchConfig(budget=16),
                     threads=2, native=True)
    core.add_rollout("p", [9], [1, 2, 3, 4, 5, 6, 1, 2, 7, 8, 1, 5, 5], 0)
    h = core.start("p", [9], [])
    first = core.step([h], [1], [0, 1], [4])
    assert core.take_span() is None
    core.prefetch([h], first.tokens, first.offsets, first.probs, 4, absorb=[h])
    core.wait_idle(10.0)
    time.sleep(0.05)  # the forward goes on after the prefetch has finished
    core.stop(cancel=True)
    span = core.take_span()
    assert 0 < span.chosen == span.done == len(core.collect())
    assert 0 < span.work_s < span.window_s and span.window_s >= 0.05
    assert core.take_span() is None  # reported once
    core.prefetch([h], first.tokens, first.offsets, first.probs, 4)
    core.stop()  # a stop that waits for the work: no forward ended it
    assert core.take_span() is None
    core.close()


def test_a_new_budget_changes_how_many_outcomes_the_next_prefetch_looks_up():
    trace = read_trace(next(p for p in builtin_traces() if "gsm" in p and "t0.6" in p))
    for core in pair(HistoryConfig(), DrafterConfig(stop_tokens=tuple(trace.header.eos_token_ids)),
                     PrefetchConfig(budget=2)):
        for r in trace.rollouts:
            if r.epoch < 3:
                core.add_rollout(r.prompt_id, r.prompt, r.output, r.epoch)
        running = [r for r in trace.rollouts if r.epoch == 3][:8]
        handles = [core.start(r.prompt_id, r.prompt, [], True) for r in running]
        drafts = core.step(handles, [r.output[0] for r in running], list(range(len(running) + 1)), [8] * 8)
        core.absorb(handles, now=True)
        looked = []
        for budget in (2, 8, 2):
            core.set_budget(budget)
            core.prefetch(handles, drafts.tokens, drafts.offsets, drafts.probs, 8)
            looked.append(len(core.collect()))
        assert looked[0] == looked[2] == 2 * len(handles) < looked[1] <= 8 * len(handles), type(core).__name__
        assert core.prefetch_config.budget == 2


def outcomes_by_row(outcomes: OutcomeBatch) -> dict[int, list[tuple[int, int, float]]]:
    rows: dict[int, list[tuple[int, int, float]]] = {}
    for row, j, b, p in zip(outcomes.rows.tolist(), outcomes.accepted.tolist(), outcomes.token.tolist(),
                            outcomes.probability.tolist(), strict=True):
        rows.setdefault(row, []).append((j, b, p))
    return rows


@pytest.mark.parametrize("shared", [False, True], ids=["per-request", "shared"])
def test_a_cancelled_prefetch_has_made_the_likeliest_lookups_first(shared):
    """The next step cancels what the forward left no time for. Whenever that comes, each row has
    kept a prefix of its outcomes, likeliest first, and: with a budget per request, no row has
    looked beyond its first 16 while another still lacks them; with a budget shared across the
    batch, no outcome kept is less likely than one dropped. A forward too short for the budget
    leaves the likeliest drafts, not some rows all of theirs and the others none."""
    trace = read_trace(next(p for p in builtin_traces() if "gsm" in p and "t0.6" in p))
    budget = 32 if shared else 64  # shared: each row may take twice its share
    core = make_core(HistoryConfig(), DrafterConfig(stop_tokens=tuple(trace.header.eos_token_ids)),
                     PrefetchConfig(budget=budget, share_budget=shared, plan_floor=0.0), threads=1, native=True)
    last = max(r.epoch for r in trace.rollouts)
    for r in trace.rollouts:
        if r.epoch < last:
            core.add_rollout(r.prompt_id, r.prompt, r.output, r.epoch)
    running = [r for r in trace.rollouts if r.epoch == last] * 4  # siblings in flight: a prefetch of tens of ms
    handles = [core.start(r.prompt_id, r.prompt, [], True) for r in running]
    committed = [r.output[:2] for r in running]
    offsets = np.cumsum([0] + [len(c) for c in committed])
    drafts = core.step(handles, [t for c in committed for t in c], offsets, [8] * len(handles))
    core.absorb(handles, now=True)

    def prefetch(wait: float | None) -> dict[int, list[tuple[int, int, float]]]:
        core.prefetch(handles, drafts.tokens, drafts.offsets, drafts.probs, 8)
        if wait is None:
            return outcomes_by_row(core.collect())
        core.wait_idle(wait)
        return outcomes_by_row(core.collect(cancel=True))

    full = prefetch(None)
    total = sum(map(len, full.values()))
    assert total > (budget if shared else 40) * len(handles) * 0.6  # the budget is mostly used
    first = {row: min(16, len(outcomes)) for row, outcomes in full.items()}
    partial = 0
    for wait in [0.0002 * 1.5 ** i for i in range(24)]:
        kept = prefetch(wait)
        for row, outcomes in kept.items():
            assert outcomes == full[row][:len(outcomes)], f"row {row} kept {outcomes}, not a prefix"
        done = sum(map(len, kept.values()))
        if shared:
            if 0 < done < total:
                partial += 1
                least_kept = min(p for outcomes in kept.values() for _, _, p in outcomes)
                dropped = [p for row, outcomes in full.items() for _, _, p in outcomes[len(kept.get(row, [])):]]
                assert max(dropped) <= least_kept, f"kept {least_kept}, dropped {max(dropped)} (wait {wait})"
        elif any(len(outcomes) > 16 for outcomes in kept.values()):
            partial += done < total
            short = [row for row in full if len(kept.get(row, [])) < first[row]]
            assert not short, f"{len(short)} rows lack their first outcomes while others looked further (wait {wait})"
    assert partial > 0  # some cancel came while the lookups were under way
    core.close()


def trace_run(path: str, batch: int, limit: int, threads: int) -> tuple[int, int]:
    """Epoch 3 of a trace (or its last, if earlier: three epochs of history, before an RL run's
    policy has converged and its drafts match whole rollouts) with ``batch`` requests in flight,
    each step committing what the draft matched of the rollout plus its next token; both cores
    side by side. Returns the steps, and the native core's lookups that resumed from the match
    states its outcome model walked."""
    trace = read_trace(path)
    stops = tuple(trace.header.eos_token_ids)
    config = (HistoryConfig(), DrafterConfig(stop_tokens=stops), PrefetchConfig(budget=4))
    ref, nat = pair(*config, threads=threads)
    last = min(3, max(r.epoch for r in trace.rollouts))
    for r in trace.rollouts:
        if r.epoch < last:
            ref.add_rollout(r.prompt_id, r.prompt, r.output, r.epoch)
            nat.add_rollout(r.prompt_id, r.prompt, r.output, r.epoch)
    waiting = [r for r in trace.rollouts if r.epoch == last][:limit]
    live: dict[int, list] = {}
    steps = 0
    while waiting or live:
        while len(live) < batch and waiting:
            r = waiting.pop(0)
            h = ref.start(r.prompt_id, r.prompt, [], True)
            assert nat.start(r.prompt_id, r.prompt, [], True) == h
            live[h] = [r, 0, []]
        handles = list(live)
        committed = []
        for h in handles:
            r, i, draft = live[h]
            j = 0
            while j < len(draft) and i + j < len(r.output) and draft[j] == r.output[i + j]:
                j += 1
            committed.append(r.output[i:i + j + 1])
            live[h][1] = i + len(committed[-1])
        offsets = np.cumsum([0] + [len(c) for c in committed])
        flat = [t for c in committed for t in c]
        ks = [8] * len(handles)
        a, b = ref.step(handles, flat, offsets, ks), nat.step(handles, flat, offsets, ks)
        same_drafts(a, b, f"{os.path.basename(path)} step {steps}")
        ref.prefetch(handles, a.tokens, a.offsets, a.probs, 8, absorb=handles)  # inserts first, one job
        nat.prefetch(handles, b.tokens, b.offsets, b.probs, 8, absorb=handles)
        same_outcomes(ref.collect(), nat.collect(), f"{os.path.basename(path)} step {steps}")
        for i, h in enumerate(handles):
            live[h][2] = a.draft(i).tokens
            if live[h][1] >= len(live[h][0].output):
                ref.finish(h, last)
                nat.finish(h, last)
                del live[h]
        steps += 1
    same_state(ref, nat, path)
    return steps, nat.timings()["resumed_lookups"]


@pytest.mark.parametrize("path", builtin_traces(), ids=os.path.basename)
def test_native_equals_reference_on_shipped_traces(path):
    steps, resumed = trace_run(path, batch=16, limit=48, threads=2)
    assert steps > 20
    assert resumed > 0  # the drafts above were also made from walked match states


@pytest.mark.parametrize("native_core", [False, True], ids=["reference", "native"])
def test_a_steps_drafts_do_not_depend_on_the_order_of_its_rows(native_core):
    """Two cores step the same requests through the same tokens, one with each batch in the order
    the requests came, one shuffled (an engine moves rows as requests finish): every draft is the
    same. (Sibling samples enter their prompt's index in some order; the order decides ties.)"""
    trace = read_trace(next(p for p in builtin_traces() if "products" in p))
    config = (HistoryConfig(), DrafterConfig(stop_tokens=tuple(trace.header.eos_token_ids)), PrefetchConfig(budget=4))
    ordered, shuffled = (make_core(*config, threads=2, native=native_core, follow=True) for _ in range(2))
    for r in trace.rollouts:
        if r.epoch == 0:
            for core in (ordered, shuffled):
                core.add_rollout(r.prompt_id, r.prompt, r.output, r.epoch)
    waiting = [r for r in trace.rollouts if r.epoch in (1, 2)][:300]
    live: dict[int, list] = {}
    rng = random.Random(3)
    rows = 0
    while waiting or live:
        while len(live) < 16 and waiting:
            r = waiting.pop(0)
            h = ordered.start(r.prompt_id, r.prompt, [], True)
            assert shuffled.start(r.prompt_id, r.prompt, [], True) == h
            live[h] = [r, 0, []]
        committed = {}
        for h, (r, i, draft) in live.items():
            j = 0
            while j < len(draft) and i + j < len(r.output) and draft[j] == r.output[i + j]:
                j += 1
            committed[h] = r.output[i:i + j + 1]
            live[h][1] = i + len(committed[h])
        drafts = []
        for core, order in ((ordered, sorted(live)), (shuffled, rng.sample(sorted(live), len(live)))):
            offsets = np.cumsum([0] + [len(committed[h]) for h in order])
            made = core.step(order, [t for h in order for t in committed[h]], offsets, [8] * len(order))
            core.absorb(order, now=True)
            drafts.append({h: made.draft(i).tokens for i, h in enumerate(order)})
        assert drafts[0] == drafts[1], f"after {rows} row-steps"
        rows += len(live)
        for h in list(live):
            live[h][2] = drafts[0][h]
            if live[h][1] >= len(live[h][0].output):
                ordered.finish(h, live[h][0].epoch)
                shuffled.finish(h, live[h][0].epoch)
                del live[h]
    assert rows > 1000


def test_an_extension_built_from_older_sources_is_not_used(monkeypatch):
    import sys
    from types import SimpleNamespace

    import ngramrl
    from ngramrl.core.batch import make_core

    stale = SimpleNamespace(Core=type("Core", (), {}))  # no step_cost_solve: built before it existed
    monkeypatch.setitem(sys.modules, "ngramrl._native", stale)
    monkeypatch.setattr(ngramrl, "_native", stale, raising=False)
    assert native_module() is None
    assert not make_core().native  # the reference, with one logged line
    with pytest.raises(RuntimeError, match="not built"):
        make_core(native=True)


def first_draft(core, prompt_id: str, prompt: list[int], context: list[int], k: int = 4):
    h = core.start(prompt_id, prompt, [])
    return core.step([h], context, [0, len(context)], [k]).draft(0)


def test_shorter_frequent_contexts_outvote_a_split_longest_match():
    """After "0 5 1 2" the history saw 3 once and 7 once, after "1 2" ten times 4: following the
    longest match drafts 3 or 7; the interpolated estimate (p(4) = 1/3 > p(3) = 0.25 + 1/30)
    drafts 4, in both cores alike."""
    drafts = []
    for core in pair(HistoryConfig(prompt_tail=0), DrafterConfig(use_global=False), PrefetchConfig(budget=4)):
        core.add_rollout("p", [0], [5, 1, 2, 3, 9], 0)
        core.add_rollout("p", [0], [5, 1, 2, 7, 9], 0)
        for _ in range(10):
            core.add_rollout("p", [0], [6, 1, 2, 4, 9], 0)
        drafts.append(first_draft(core, "p", [0], [5, 1, 2]))
    assert drafts[0] == drafts[1]
    assert drafts[0].tokens[0] == 4 and drafts[0].source == "prompt"
    assert drafts[0].probs[0] > 0.25 + 1 / 30


def test_the_prompts_own_history_comes_before_a_longer_cross_prompt_match():
    """Another prompt matches "8 1 2" (then 5), this prompt only "1 2" (then 4): the prompt's own
    levels are read first, so the draft is 4, from the prompt, in both cores alike."""
    drafts = []
    for core in pair(HistoryConfig(prompt_tail=0), DrafterConfig(use_global=True), PrefetchConfig(budget=4)):
        core.add_rollout("p", [0], [1, 2, 4, 6], 0)
        for _ in range(3):
            core.add_rollout("q", [3], [8, 1, 2, 5, 6], 0)
        drafts.append(first_draft(core, "p", [0], [8, 1, 2]))
    assert drafts[0] == drafts[1]
    assert drafts[0].tokens[0] == 4 and drafts[0].source == "prompt" and drafts[0].matched == 2


@pytest.mark.parametrize("width", [4, 9])  # 9: past the native core's cached ranking threshold (8)
def test_equally_frequent_continuations_rank_by_token_id_after_the_newest(width):
    """A state followed once each by ``width`` tokens: the draft is the newest (the index's best
    continuation); after rejecting it, the two corrections a budget of 2 keeps are the two lowest
    token ids among the rest (each level proposes its top two in the index's ranking), not the
    two seen first, in both cores alike. (A long rollout of other tokens keeps the empty context's
    estimates of the frequent prefix tokens below those corrections.)"""
    followers = [9, 3, 7, 5, 11, 4, 8, 6, 10][:width]
    results = []
    for core in pair(HistoryConfig(prompt_tail=0), DrafterConfig(use_global=False), PrefetchConfig(budget=2)):
        core.add_rollout("p", [0], list(range(100, 300)), 0)
        for t in followers:
            core.add_rollout("p", [0], [1, 2, t], 0)
        h = core.start("p", [0], [])
        draft = core.step([h], [1, 2], [0, 2], [1])
        core.absorb([h])
        core.prefetch([h], draft.tokens, draft.offsets, draft.probs, 1)
        outcomes = core.collect()
        predicted = [(int(j), int(b)) for j, b in zip(outcomes.accepted, outcomes.token, strict=True)]
        results.append((draft.draft(0), predicted))
    assert results[0] == results[1]
    draft, predicted = results[0]
    assert draft.tokens == [followers[-1]]
    assert sorted(b for j, b in predicted if j == 0) == sorted(followers[:-1])[:2]


def test_rankings_stay_exact_as_live_sequences_extend_the_index():
    """The native core keeps a long continuation list's ranking head current through each extend
    (only the appended token's count grows; the best continuation can only become it), and ranks
    the list again where the demoted best ties with the head's last entry. A state with 40
    continuations seen once each (a head of 33 is a prefix of its ranking: the newest first, then
    by token id) followed again and again by them and by new tokens gives the same rankings in
    both cores after every step, ties at the head's end included."""
    rng = random.Random(7)
    cores = pair(HistoryConfig(prompt_tail=0), DrafterConfig(use_global=False), PrefetchConfig(budget=32))
    followers = list(range(100, 140))  # the newest, the best of equals, has the highest id: it leaves the head
    handles = []
    for core in cores:
        core.add_rollout("p", [0], [7] * 50, 0)
        for t in followers:
            core.add_rollout("p", [0], [1, 2, t], 0)
        handles.append(core.start("p", [0], []))
    assert handles[0] == handles[1]
    compared = 0
    for step in range(150):
        for m in (33, 5):  # the outcome model's budget + 1 first: the head the native core caches
            for context in ([1, 2], [2], []):
                ranked = [core.continuations("p", [0], context, m) for core in cores]
                assert ranked[0] == ranked[1], f"step {step}, m {m}, after {context}"
                compared += len(ranked[0])
        token = rng.randrange(100, 150)  # counts rise evenly: the best changes among equals, and new ones come
        for core in cores:
            core.step([handles[0]], [1, 2, token], [0, 3], [1])
            core.absorb([handles[0]])
    assert compared > 10000
    for core in cores:
        with pytest.raises(ValueError, match="m must be >= 0"):
            core.continuations("p", [0], [1, 2], -1)


@pytest.mark.parametrize("path_width", [2, 4])
def test_chains_chosen_from_trees_are_the_same_in_both_cores(path_width):
    drafted = 0
    for seed in (3, 8, 21):
        rng = random.Random(seed)
        history, drafter, prefetch = random_config(rng)
        drafter = DrafterConfig(**{**drafter.__dict__, "path_width": path_width})
        ref, nat = pair(history, drafter, prefetch)
        for epoch in range(2):
            for p in range(3):
                out = [rng.randrange(6) for _ in range(40)]
                ref.add_rollout(f"p{p}", [1], out, epoch)
                nat.add_rollout(f"p{p}", [1], out, epoch)
        for p in range(3):
            context = [rng.randrange(6) for _ in range(5)]
            a, b = first_draft(ref, f"p{p}", [1], context, 8), first_draft(nat, f"p{p}", [1], context, 8)
            assert a == b, (seed, p)
            drafted += len(a)
    assert drafted > 10


def thread_cores() -> dict[str, str]:
    """This process's threads (ids) and the cores each may run on (Linux's Cpus_allowed_list)."""
    cores = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/status") as status:
                cores[task] = next(line.split()[1] for line in status if line.startswith("Cpus_allowed_list"))
        except (OSError, StopIteration):
            pass  # the thread ended
    return cores


@pytest.mark.skipif(not os.path.exists("/proc/self/task") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two cores to pin a thread to one of them")
@pytest.mark.parametrize("threads", [1, 3])
def test_the_workers_run_on_the_cores_given_and_the_caller_stays_where_it_was(threads):
    usable = sorted(os.sched_getaffinity(0))
    before = thread_cores()
    core = make_core(threads=threads, cores=[usable[-1]], native=True)
    workers = {task: cores for task, cores in thread_cores().items() if task not in before}
    assert len(workers) == max(1, threads - 1)
    assert set(workers.values()) == {str(usable[-1])}
    assert os.sched_getaffinity(0) == set(usable)
    h = core.start("p", [1, 2, 3], [])
    core.prefetch([h], [4], [0, 1], [0.5], 4)  # a background job on the pinned worker runs to its end
    core.collect()
    del core
    before = thread_cores()
    unpinned = make_core(threads=2, native=True)  # no cores: wherever the process may run
    workers = {task: cores for task, cores in thread_cores().items() if task not in before}
    assert unpinned.cores == frozenset() and workers and set(workers.values()) == {before[str(os.getpid())]}


@pytest.mark.parametrize("native", [False, True])
def test_drop_ended_takes_lingering_outputs_out_and_nothing_else(native):
    """An output that ended lingering serves its prompt's lookups until ``drop_ended``; after it,
    the prompt's window still serves them, and neither the recency order nor another prompt's
    index moves."""
    history, drafter, prefetch = HistoryConfig(prompt_tail=0), DrafterConfig(), PrefetchConfig()
    core = (make_core(history, drafter, prefetch, native=True) if native
            else ReferenceCore(history, drafter, prefetch))
    core.add_rollout("p", [1, 2], [10, 11, 12, 13], 0)
    core.add_rollout("q", [3, 4], [20, 21, 22, 23], 0)
    ended = core.start("p", [1, 2], [30, 31, 32, 33])
    core.finish(ended, None, linger=True)
    assert core.lookup_context("p", [1, 2], [30, 31], 2).tokens == [32, 33]
    order, q_index = core.prompt_ids(), core.index_shape("q")
    core.drop_ended(["p", "unknown"])
    assert core.prompt_ids() == order and core.index_shape("q") == q_index
    assert core.index_shape("p") == (-1, -1, -1)
    assert core.lookup_context("p", [1, 2], [30, 31], 2).tokens == []
    assert core.lookup_context("p", [1, 2], [10, 11], 2).tokens == [12, 13]
    core.drop_ended(["q"])  # nothing of q ended lingering: its index stays
    assert core.index_shape("q") == q_index


def test_bad_estimates_token_ids_and_lengths_are_refused_before_anything_changes():
    """The calls that take drafts' estimates, committed or drafted tokens, or a restored window
    check them first (in C++ an unchecked offset or estimate wrote past its buffer, a negative k
    ended the process, a negative token id entered the index as "no continuation")."""
    ref, nat = pair(HistoryConfig(prompt_tail=0), DrafterConfig(use_global=False), PrefetchConfig())
    fit = (0.03, 0.001, 0.001, 0.0, 0)
    for core in (ref, nat):
        core.add_rollout("p", [9], [1, 2, 3, 4], 0)
        h = core.start("p", [9], [1], register=True)
        core.step([h], [2], [0, 1], [3])
        calibration, exported = core.calibration_state(), core.export()
        for probs, offsets, message in (([0.5], [0, 2_000_000], "offsets must rise from 0 to the 1 estimates"),
                                        ([0.5, 0.5, 0.5, 0.5, 0.5], [0, 5, 3], "offsets must rise"),
                                        ([0.5], [], "offsets needs rows \\+ 1 entries"),
                                        ([0.5, -0.5], [0, 2], r"estimates\[1\] = -0.5.* is not a probability"),
                                        ([float("nan")], [0, 1], r"estimates\[0\] = nan is not a probability"),
                                        ([1.5], [0, 1], "not a probability"),
                                        ([0.5] * 5 + [float("nan")] + [0.5] * 4, [0, 10], r"estimates\[5\] = nan")):
            with pytest.raises(ValueError, match=message):
                core.observe(probs, offsets, [0] * max(0, len(offsets) - 1))
            with pytest.raises(ValueError, match=message):
                core.chances(probs, offsets)
            with pytest.raises(ValueError, match=message):
                core.lengths(probs, offsets, 1.0, fit, 0.0)
        with pytest.raises(ValueError, match="accepted has 2 entries for 1 drafts"):
            core.observe([0.5], [0, 1], [0, 1])
        with pytest.raises(ValueError, match=r"accepted\[0\] = -1 is negative"):
            core.observe([0.5], [0, 1], [-1])
        with pytest.raises(ValueError, match="k must be >= 0, got -1"):
            core.prefetch([h], [3], [0, 1], [0.5], -1)
        with pytest.raises(ValueError, match=r"draft tokens\[0\] = -1 is negative"):
            core.prefetch([h], [-1], [0, 1], [0.5], 3)
        with pytest.raises(ValueError, match="not a probability"):
            core.prefetch([h], [3], [0, 1], [float("nan")], 3)
        with pytest.raises(ValueError, match=r"committed tokens\[1\] = -1 is negative"):
            core.step([h], [3, -1], [0, 2], [3])
        with pytest.raises(ValueError, match=r"committed tokens\[0\] = -2147483642 is negative"):
            core.step([h], np.array([2**31 + 6], dtype=np.int64), [0, 1], [3])
        with pytest.raises(ValueError, match="= -1 is negative"):
            core.restore([["p", [9], [[1, [5, -1, 6]]]]], replace=True)
        with pytest.raises(ValueError, match="must be an integer >= 0, got -5"):
            core.restore([["p", [9], [[-5, [5, 6]]]]], replace=True)
        assert core.calibration_state() == calibration and core.export() == exported
        assert core.step([h], [3], [0, 1], [3]).tokens.tolist() == [4]  # the request goes on as it was
        core.prefetch([h], [4], [0, 1], [0.5], 0)  # k = 0: outcomes without drafts, as the reference's
        assert (core.collect().drafts.matched == 0).all()


def test_estimates_on_long_repetitive_histories_stay_probabilities_in_both_cores():
    """Rollouts that repeat one output thousands of tokens long: every suffix level says the same
    token, and the sum of the levels' shares can pass 1 in floating point. Both cores' drafts keep
    their estimates in [0, 1] (their own prefetch and the proposer's length choice refuse anything
    else), and stay the same in both."""
    trace = read_trace(next(p for p in builtin_traces() if "bfcl-smollm2-t0.6" in p))
    prompt_ids = sorted({r.prompt_id for r in trace.rollouts})[:2]
    rollouts = [r for r in trace.rollouts if r.prompt_id in prompt_ids]
    long = {id(r): (r.output[:-1] * (6000 // max(1, len(r.output) - 1) + 1))[:6000] for r in rollouts}
    ref, nat = pair(HistoryConfig(), DrafterConfig(stop_tokens=tuple(trace.header.eos_token_ids)),
                    PrefetchConfig(budget=4))
    for core in (ref, nat):
        for r in rollouts:
            if r.epoch < 3:
                core.add_rollout(r.prompt_id, r.prompt, long[id(r)], r.epoch)
    highest = 0.0
    for r in [r for r in rollouts if r.epoch == 3]:
        output = long[id(r)]
        handles = [core.start(r.prompt_id, r.prompt, [], True) for core in (ref, nat)]
        position, committed = 1, output[:1]
        while position < len(output):
            a, b = (core.step([h], committed, [0, len(committed)], [16])
                    for core, h in zip((ref, nat), handles, strict=True))
            same_drafts(a, b, f"{r.prompt_id} at {position}")
            highest = max(highest, float(a.probs.max(initial=0.0)))
            for core, h in zip((ref, nat), handles, strict=True):
                core.prefetch([h], a.tokens, a.offsets, a.probs, 16, absorb=[h])
                core.lengths(a.probs, a.offsets, 1.0, (1e-3, 1e-5, 0.0, 1e-6, 0), 0.0)
                core.collect()
            accepted = 0
            while accepted < len(a.tokens) and position + accepted < len(output) \
                    and a.tokens[accepted] == output[position + accepted]:
                accepted += 1
            committed = output[position:position + accepted + 1]
            position += len(committed)
        for core, h in zip((ref, nat), handles, strict=True):
            core.finish(h)
    assert 0.999 < highest <= 1.0  # the histories made drafts as certain as they come


@pytest.mark.parametrize("native_core", [False, True], ids=["reference", "native"])
def test_handles_keep_rising_and_finished_requests_leave_nothing_behind(native_core):
    """A long run starts millions of requests: handles keep rising (they rank requests by
    arrival), a finished handle is no live request, and once the oldest request still running
    ends, the core's memory does not grow with the requests that ended, in whatever order."""
    core = make_core(native=native_core)
    core.add_rollout("p", [1, 2, 3], [10, 11, 12, 2], 0)
    straggler = core.start("p", [1, 2, 3], [], True)
    handles, sizes = [], []
    for round_ in range(3):
        for _ in range(2000 if round_ else 200):
            batch = core.start_many(["p"] * 4, [[1, 2, 3]] * 4, [[]] * 4, True)
            handles.extend(batch)
            core.finish_many(batch[::-1])
        if round_ == 0:
            assert core.known(straggler)  # still live among the requests that ended after it came
            core.finish(straggler)
        core.wait_idle(5.0)
        if native_core:
            sizes.append(core.memory_bytes())
    assert handles == sorted(handles) and len(set(handles)) == len(handles) and handles[0] > straggler
    with pytest.raises(ValueError, match=f"request handle {handles[-1]} is not a live request"):
        core.finish(handles[-1])
    assert core.start("p", [1, 2, 3], [], True) == handles[-1] + 1
    if native_core:
        assert sizes[2] - sizes[1] < 8 * 1000  # 8000 requests started and ended in between


@pytest.mark.parametrize("native_core", [False, True], ids=["reference", "native"])
def test_a_lookup_that_found_nothing_is_followed_as_a_forward_that_accepts_nothing(native_core):
    """What whole drafts would give (``followed``: drafts, accepted tokens) counts an empty draft
    as one forward committing the target's token alone, as verifying it would; a draft followed
    over several steps counts once."""
    core = make_core(HistoryConfig(), DrafterConfig(), PrefetchConfig(), native=native_core, follow=True)
    core.add_rollout("p", [1, 2], [10, 11, 12, 13], 0)
    handle = core.start("p", [1, 2], [], True)
    assert core.step([handle], [99], [0, 1], [4]).tokens.tolist() == []  # 99 was never seen
    assert core.followed() == (1, 0)
    assert core.step([handle], [10], [0, 1], [4]).tokens.tolist() == [11, 12, 13]
    assert core.followed() == (1, 0)  # followed from now on
    core.step([handle], [11], [0, 1], [4])  # the next token matches: still followed
    assert core.followed() == (1, 0)
    assert core.step([handle], [12, 5], [0, 2], [4]).tokens.tolist() == []  # 2 accepted; 5 was never seen
    assert core.followed() == (3, 2)
