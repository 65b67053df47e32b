"""The prefetcher changes when drafts are computed, never which: decoding is identical with it off,
on at several budgets, and with lookup workers that are slow, raise, or answer late."""

import asyncio
import random

import pytest
import torch

from ngramrl.config import DrafterConfig, HistoryConfig, PrefetchConfig
from ngramrl.core.drafter import NgramDrafter
from ngramrl.core.history import RolloutHistory
from ngramrl.core.outcome import (
    GROW_SHARE,
    GROW_STEP,
    AcceptanceCalibration,
    Outcome,
    PrefetchSpan,
    accepted_length_distribution,
    allocate,
    allocation,
    budget_cut,
    budget_total,
    next_budget,
    predict_outcomes,
)
from ngramrl.core.prefetch import Prefetcher, ThreadLookupWorker
from ngramrl.core.verifier import SamplingSettings, verify

VOCAB = 40
EOS = 1
K = 6


def toy_model(seed=0):
    g = torch.Generator().manual_seed(seed)
    table = torch.randn((VOCAB, VOCAB, VOCAB), generator=g) * 3.0
    table[..., EOS] -= 2.0
    return table


def logits_at(table, context):
    return table[context[-2], context[-1]]


def plain_rollout(table, prompt, temperature, seed, max_len):
    g = torch.Generator().manual_seed(seed)
    settings = SamplingSettings.uniform(1, temperature=temperature)
    out = []
    while len(out) < max_len:
        logits = logits_at(table, prompt + out).view(1, 1, VOCAB)
        token = int(verify(logits, torch.zeros((1, 0), dtype=torch.long), torch.zeros(1, dtype=torch.long),
                           settings, g).emitted[0])
        out.append(token)
        if token == EOS:
            break
    return out


def warm_history(table, prompts, temperature):
    history = RolloutHistory(HistoryConfig(prompt_tail=2))
    for pid, prompt in prompts.items():
        for sample in range(4):
            history.add_rollout(pid, prompt, plain_rollout(table, prompt, temperature, 1000 + sample, 40), epoch=0)
    return history


class SlowWorker(ThreadLookupWorker):
    async def lookup(self, request, after, k):
        await asyncio.sleep(random.random() * 0.002)
        return await super().lookup(request, after, k)


class RaisingWorker(ThreadLookupWorker):
    calls = 0

    async def lookup(self, request, after, k):
        RaisingWorker.calls += 1
        if RaisingWorker.calls % 2:
            raise RuntimeError("drafter shard died")
        return await super().lookup(request, after, k)


class LateWorker(ThreadLookupWorker):
    async def lookup(self, request, after, k):
        await asyncio.sleep(1.0)  # answers long after the outcome is known
        return await super().lookup(request, after, k)


async def decode(table, prompts, temperature, prefetch=None, worker_cls=None, max_len=40):
    """Decode one sample per prompt, all requests stepping together; returns outputs and stats."""
    history = warm_history(table, prompts, temperature)
    drafter = NgramDrafter(history, DrafterConfig(max_draft=K, stop_tokens=(EOS,)))
    prefetcher = None
    if prefetch is not None:
        worker = worker_cls(drafter) if worker_cls else None
        prefetcher = Prefetcher(drafter, prefetch, worker)
    settings = SamplingSettings.uniform(1, temperature=temperature)
    requests = {pid: drafter.start(f"{pid}/live", pid, prompt) for pid, prompt in prompts.items()}
    generators = {pid: torch.Generator().manual_seed(7 + i) for i, pid in enumerate(prompts)}
    drafts = {pid: drafter.propose(request, K) for pid, request in requests.items()}
    live = set(prompts)
    drafted = 0
    while live:
        if prefetcher:
            prefetcher.dispatch([(requests[pid], drafts[pid], K) for pid in sorted(live)])
        await asyncio.sleep(0.001)  # the target's forward: prefetch lookups run meanwhile
        for pid in sorted(live):
            request, draft = requests[pid], drafts[pid]
            context = prompts[pid] + request.output
            tokens = draft.tokens[: K]
            logits = torch.stack([logits_at(table, context + tokens[:i]) for i in range(len(tokens) + 1)])
            padded = torch.tensor([tokens + [0] * (K - len(tokens))])
            full = torch.cat([logits, logits[-1:].expand(K - len(tokens), VOCAB)]) if len(tokens) < K else logits
            result = verify(full.unsqueeze(0), padded, torch.tensor([len(tokens)]), settings, generators[pid])
            accepted, emitted = int(result.accepted[0]), int(result.emitted[0])
            drafted += accepted
            committed = tokens[:accepted] + [emitted]
            done = EOS in committed or len(request.output) + len(committed) >= max_len
            if prefetcher:
                drafts[pid], _ = prefetcher.next_draft(request, accepted, emitted)
            else:
                drafter.commit(request, committed)
                drafts[pid] = drafter.propose(request, K)
            if done:
                if prefetcher:
                    prefetcher.cancel(request.request_id)
                live.discard(pid)
    outputs = {pid: request.output[:max_len] for pid, request in requests.items()}
    return outputs, drafted, prefetcher.stats if prefetcher else None


PROMPTS = {f"p{i}": [2 + i, 10 + i, 20 + i] for i in range(4)}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_outputs_identical_with_prefetch_off_on_and_faulty_workers(temperature):
    table = toy_model()
    reference, drafted, _ = asyncio.run(decode(table, PROMPTS, temperature))
    assert drafted > 0, "the drafter must actually draft for this test to mean something"
    configs = [(PrefetchConfig(budget=b), None) for b in (1, 4, 16)]
    configs += [(PrefetchConfig(budget=8), SlowWorker), (PrefetchConfig(budget=8), RaisingWorker),
                (PrefetchConfig(budget=8), LateWorker), (PrefetchConfig(budget=16, global_budget=5), None)]
    hits = 0
    for config, worker in configs:
        outputs, _, stats = asyncio.run(decode(table, PROMPTS, temperature, config, worker))
        assert outputs == reference, (config, worker)
        hits += stats.hits
        if worker is LateWorker:
            assert stats.hits == 0 and stats.late > 0
        if worker is RaisingWorker:
            assert stats.failed > 0
    assert hits > 0, "some outcomes must be served from the prefetch"


def test_greedy_outputs_equal_plain_decoding():
    table = toy_model(3)
    outputs, _, _ = asyncio.run(decode(table, PROMPTS, 0.0, PrefetchConfig(budget=4)))
    for pid, prompt in PROMPTS.items():
        assert outputs[pid] == plain_rollout(table, prompt, 0.0, 0, 40)


def first_draft(seed, temperature, prompt_id, path_width=1):
    """A drafter warmed on the toy model's rollouts, and the first draft of a new request."""
    history = warm_history(toy_model(seed), PROMPTS, temperature)
    drafter = NgramDrafter(history, DrafterConfig(max_draft=K, path_width=path_width))
    request = drafter.start("r", prompt_id, PROMPTS[prompt_id])
    return history, drafter, request, drafter.propose(request, K)


def ordinary_draft_after(drafter, request, prompt_id, committed):
    """The draft an ordinary lookup makes once ``committed`` is known, from a twin of the request."""
    twin = drafter.start("twin", prompt_id, PROMPTS[prompt_id], output=list(request.output))
    drafter.commit(twin, committed)
    tokens = drafter.lookup(twin, K).tokens
    drafter.finish(twin)
    return tokens


@pytest.mark.parametrize("path_width", [1, 3])
def test_prefetched_draft_is_the_draft_an_ordinary_lookup_makes(path_width):
    history, drafter, request, draft = first_draft(seed=5, temperature=0.8, prompt_id="p0", path_width=path_width)
    for j in range(len(draft.tokens) + 1):
        for b in range(0, VOCAB, 7):
            ahead = drafter.lookup(request, K, draft.tokens[:j] + [b])
            assert ordinary_draft_after(drafter, request, "p0", draft.tokens[:j] + [b]) == ahead.tokens


def test_a_tree_looked_up_ahead_is_the_tree_an_ordinary_lookup_makes():
    history, drafter, request, draft = first_draft(seed=5, temperature=0.8, prompt_id="p0")
    grown = 0
    for j in range(len(draft.tokens) + 1):
        for b in range(0, VOCAB, 9):
            after = draft.tokens[:j] + [b]
            ahead = drafter.lookup_tree(request, K, 3, after)
            twin = drafter.start("twin", "p0", PROMPTS["p0"], output=list(request.output))
            drafter.commit(twin, after)
            now = drafter.lookup_tree(twin, K, 3)
            drafter.finish(twin)
            assert (ahead.tokens, ahead.parents, ahead.probs) == (now.tokens, now.parents, now.probs)
            grown += len(set(ahead.parents)) > 1  # a tree with a branch
    assert grown > 0


def test_accepted_length_distribution_sums_to_one():
    dist = accepted_length_distribution([0.9, 0.5, 0.2])
    assert dist == pytest.approx([0.1, 0.45, 0.36, 0.09])
    assert sum(accepted_length_distribution([])) == 1.0


def test_predicted_outcomes_never_include_the_rejected_draft_token_and_are_sorted():
    history, drafter, request, draft = first_draft(seed=6, temperature=1.0, prompt_id="p1")
    assert draft.tokens
    index = history.index_of("p1")
    outcomes = predict_outcomes([(index, request.match)], draft, draft.probs, 16)
    assert 0 < len(outcomes) <= 16
    probabilities = [o.probability for o in outcomes]
    assert probabilities == sorted(probabilities, reverse=True) and sum(probabilities) <= 1.0 + 1e-9
    for outcome in outcomes:
        if outcome.accepted < len(draft.tokens):
            assert outcome.token != draft.tokens[outcome.accepted]


def test_a_floor_keeps_the_outcomes_above_it_and_the_top_ones_unchanged():
    """A prefetch enumerates only outcomes likelier than its floor (a share of the last one's cut):
    none below it, no j whose own chance is below it, and the likeliest outcomes as without it
    (the floor only stops reading suffix levels that could add nothing above it)."""
    history, drafter, request, draft = first_draft(seed=6, temperature=1.0, prompt_id="p1")
    sources = [(history.index_of("p1"), request.match)]
    chances = [0.6] * len(draft.tokens)
    full = predict_outcomes(sources, draft, chances, 32)
    floor = full[len(full) // 2].probability
    above = predict_outcomes(sources, draft, chances, 32, floor=floor)
    assert 0 < len(above) < len(full)
    assert all(o.probability > floor * (1 - 1e-12) for o in above)
    p_accepted = accepted_length_distribution(chances)
    assert all(p_accepted[o.accepted] > floor for o in above)
    assert [o.key for o in above[:3]] == [o.key for o in full[:3]]
    assert predict_outcomes(sources, draft, chances, 32, floor=0.0) == full


def test_the_cut_is_the_least_likely_outcome_chosen_when_the_budget_was_spent():
    outcomes = {"a": [Outcome(0.5, 0, 1), Outcome(0.2, 1, 2)], "b": [Outcome(0.3, 0, 4)], "c": []}
    config = PrefetchConfig(budget=1)  # shared: one lookup per request on average, three in all
    chosen = allocate(outcomes, config)
    assert budget_total(config, len(outcomes)) == 3
    assert budget_cut(chosen, budget_total(config, len(outcomes))) == 0.2
    assert budget_cut(chosen, 4) == 0.0  # budget left unspent: no cut
    assert budget_cut(chosen, None) == 0.0  # no batch total (budgets per request)
    assert budget_total(PrefetchConfig(budget=1, share_budget=False), 3) is None


def test_allocation_follows_uncertainty_under_a_global_budget():
    confident = [Outcome(0.9, 3, 5), Outcome(0.05, 0, 7), Outcome(0.01, 1, 2)]
    uncertain = [Outcome(0.1, 0, t) for t in range(8)]
    chosen = allocate({"a": confident, "b": uncertain}, PrefetchConfig(budget=16, global_budget=6))
    assert chosen["a"] == [confident[0]]
    assert len(chosen["b"]) == 5
    per_request = allocate({"a": confident, "b": uncertain},
                           PrefetchConfig(budget=2, min_probability=0.02, share_budget=False))
    assert per_request["a"] == confident[:2] and per_request["b"] == uncertain[:2]


def test_a_shared_budget_goes_to_the_batchs_likeliest_outcomes_up_to_twice_a_share():
    """The default: ``budget`` lookups per request on average, spent on the likeliest outcomes
    across the batch, at most SHARE_CAP (2) x budget for one request."""
    confident = [Outcome(0.9, 3, 5), Outcome(0.05, 0, 7), Outcome(0.01, 1, 2)]
    uncertain = [Outcome(0.1 - 0.001 * t, 0, t) for t in range(8)]
    chosen = allocate({"a": confident, "b": uncertain}, PrefetchConfig(budget=3))
    assert chosen["a"] == [confident[0]] and chosen["b"] == uncertain[:5]
    spare = allocate({"b": uncertain, "c": [], "d": []}, PrefetchConfig(budget=2))  # 6 to spend, 4 at most for b
    assert spare["b"] == uncertain[:4] and spare["c"] == spare["d"] == []
    assert allocation(PrefetchConfig(budget=5)) == (10, True)
    assert allocation(PrefetchConfig(budget=5, global_budget=7)) == (5, False)  # an explicit total wins
    assert allocation(PrefetchConfig(budget=5, share_budget=False)) == (5, False)


def test_the_budget_grows_where_the_forward_leaves_time_and_shrinks_where_it_cuts_the_lookups():
    config = PrefetchConfig(budget=16, max_budget=64)
    idle = PrefetchSpan(chosen=100, done=100, work_s=0.010, window_s=0.040)  # done in a quarter
    assert next_budget(16, config, idle) == 32
    assert next_budget(32, config, idle) == 64
    assert next_budget(64, config, idle) == 64  # not past max_budget
    half = PrefetchSpan(chosen=100, done=100, work_s=0.020, window_s=0.040)  # done in half: room for half again
    assert next_budget(32, config, half) == 48
    busy = PrefetchSpan(chosen=100, done=100, work_s=0.026, window_s=0.040)  # less than a quarter more fits: keep
    assert next_budget(32, config, busy) == 32
    nearly = PrefetchSpan(chosen=100, done=80, work_s=0.040, window_s=0.040)  # cut late: the likeliest done
    assert next_budget(64, config, nearly) == 64
    cut = PrefetchSpan(chosen=100, done=20, work_s=0.040, window_s=0.040)  # cut before a third
    assert next_budget(64, config, cut) == 32
    assert next_budget(16, config, cut) == 16  # never below budget
    planning = PrefetchSpan(chosen=-1, done=0, work_s=0.040, window_s=0.040)  # cut while planning
    assert next_budget(32, config, planning) == 16
    nothing = PrefetchSpan(chosen=0, done=0, work_s=0.0001, window_s=0.040)  # nothing to look up
    assert next_budget(16, config, nothing) == 16
    fixed = PrefetchConfig(budget=16, max_budget=8)  # at most budget: the budget stays
    assert next_budget(16, fixed, idle) == 16
    with pytest.raises(ValueError, match="max_budget must be >= 0"):
        PrefetchConfig(max_budget=-1)


def modelled_span(budget: int, window: float, plan_share: float) -> PrefetchSpan:
    """A prefetch whose work grows with its budget, ``plan_share`` of it planning before any lookup,
    cut at the end of ``window``."""
    work = 1e-4 * budget
    if work <= window:
        return PrefetchSpan(budget, budget, work, window)
    done = int(budget * max(0.0, window - plan_share * work) / ((1 - plan_share) * work))
    return PrefetchSpan(budget if window > plan_share * work else -1, done, window, window)


def test_a_budget_that_grew_into_its_window_is_not_cut_and_one_that_shrank_does_not_grow_back():
    """Work that grows with the budget (planning a share of it) settles instead of oscillating."""
    config = PrefetchConfig(budget=1, max_budget=1 << 20)
    for window in (0.01, 0.05, 0.3):
        for plan_share in (0.0, 0.3, 0.7):
            budget, seen = 1, []
            for _ in range(40):
                budget = next_budget(budget, config, modelled_span(budget, window, plan_share))
                seen.append(budget)
            assert len(set(seen[-20:])) == 1, f"window {window}, planning {plan_share}: {seen}"
            # it grew into the window: past the share it aims at, less the least step it takes
            assert modelled_span(seen[-1], window, plan_share).work_s > window * GROW_SHARE / GROW_STEP


def test_calibration_learns_from_outcomes_only():
    calibration = AcceptanceCalibration(prior_strength=2.0)
    assert calibration.chance(0, 0.8) == 0.8
    for _ in range(50):
        calibration.observe([0.8, 0.8], accepted=0)  # the first token keeps being rejected
    assert calibration.chance(0, 0.8) < 0.1
    assert calibration.chance(1, 0.8) == 0.8  # position 1 was never tried


def test_draft_follower_learns_acceptance_from_committed_tokens_verified_or_not():
    from ngramrl.core.drafter import Draft
    from ngramrl.core.outcome import DraftFollower

    calibration = AcceptanceCalibration(prior_strength=1.0)
    follower = DraftFollower(calibration)
    draft = Draft([5, 6, 7, 8], [0.5, 0.5, 0.5, 0.5])
    follower.offer("r", draft)
    follower.offer("r", Draft([9], [0.5]))   # one draft followed at a time
    follower.committed("r", [5])             # nothing verified: the target emitted d_1 on its own
    follower.committed("r", [6, 7])          # d_2 and d_3 follow in the next step
    follower.committed("r", [1])             # d_4 does not: 3 accepted
    assert calibration.chance(0, 0.5) > 0.5 and calibration.chance(3, 0.5) < 0.5
    follower.offer("s", Draft([2, 3], [0.9, 0.9]))
    follower.committed("s", [4])              # rejected at once
    assert calibration.chance(0, 0.9) < 0.9
    follower.offer("t", Draft([2], [0.9]))
    follower.drop("t")
    follower.committed("t", [2])              # a dropped request teaches nothing
    assert calibration.chance(0, 0.9) == pytest.approx((0 + 0.9) / (1 + 1.0))
