"""The prefetch changes when drafts are computed, never which: decoding through the batched cores
(reference and native) gives the same drafts and outputs with it off, on at several budgets, and
cancelled as soon as it starts; and the outcome model and the budget allocator it plans with."""

import numpy as np
import pytest
import torch

from ngramrl.config import DrafterConfig, HistoryConfig, PrefetchConfig
from ngramrl.core.batch import ReferenceCore, make_core
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


def until_eos(tokens):
    return tokens[:tokens.index(EOS) + 1] if EOS in tokens else tokens


def warm(store, table, prompts, temperature):
    """Four epoch-0 rollouts of each prompt into ``store`` (a RolloutHistory or a batched core)."""
    for pid, prompt in prompts.items():
        for sample in range(4):
            store.add_rollout(pid, prompt, plain_rollout(table, prompt, temperature, 1000 + sample, 40), epoch=0)
    return store


def decode(core, table, prompts, temperature, prefetch=False, cancel_at_once=False, max_len=40):
    """Decode one sample per prompt through a batched core as the engine drives it (a step for
    every live row, then the prefetch during the "forward" (verification), a cancelling stop at the
    next step), each row's draft verified with its own generator; finished requests become
    rollouts (their prompt's index changes, its prefetched drafts go stale). Returns the outputs,
    every step's drafts and how many drafts came from the prefetch."""
    warm(core, table, prompts, temperature)
    settings = SamplingSettings.uniform(1, temperature=temperature)
    pids = list(prompts)
    handles = dict(zip(pids, core.start_many(pids, [prompts[p] for p in pids], [[]] * len(pids), register=True),
                       strict=True))
    generators = {pid: torch.Generator().manual_seed(7 + i) for i, pid in enumerate(pids)}
    outputs = {pid: [] for pid in pids}
    committed = {pid: [] for pid in pids}
    live, steps, hits = list(pids), [], 0
    while live:
        core.stop(cancel=True)  # the forward has ended: what the prefetch did not finish is dropped
        rows = [handles[pid] for pid in live]
        tokens = [t for pid in live for t in committed[pid]]
        offsets = np.cumsum([0] + [len(committed[pid]) for pid in live])
        drafts = core.step(rows, tokens, offsets, [K] * len(rows))
        steps.append(drafts.drafts())
        hits += int(drafts.prefetched.sum())
        if prefetch:
            core.prefetch(rows, drafts.tokens, drafts.offsets, drafts.probs, K, absorb=rows)
            if cancel_at_once:
                core.stop(cancel=True)
        else:
            core.absorb(rows, now=True)
        accepted = []
        for row, pid in enumerate(live):
            draft = drafts.draft(row).tokens
            context = prompts[pid] + outputs[pid]
            logits = torch.stack([logits_at(table, context + draft[:i]) for i in range(len(draft) + 1)])
            padded = torch.tensor([draft + [0] * (K - len(draft))])
            full = torch.cat([logits, logits[-1:].expand(K - len(draft), VOCAB)]) if len(draft) < K else logits
            result = verify(full.unsqueeze(0), padded, torch.tensor([len(draft)]), settings, generators[pid])
            j, emitted = int(result.accepted[0]), int(result.emitted[0])
            accepted.append(j)
            committed[pid] = draft[:j] + [emitted]
            outputs[pid] += committed[pid]
        core.observe(drafts.probs, drafts.offsets, accepted)
        done = [pid for pid in live if EOS in outputs[pid] or len(outputs[pid]) >= max_len]
        if done:
            core.stop(cancel=True)
            core.finish_many([handles[pid] for pid in done], [1] * len(done))
        live = [pid for pid in live if pid not in done]
    return {pid: until_eos(out)[:max_len] for pid, out in outputs.items()}, steps, hits


PROMPTS = {f"p{i}": [2 + i, 10 + i, 20 + i] for i in range(4)}
# Rollouts of 40 tokens run hits past this many tokens behind, where a row left behind would
# re-match the cross-prompt index instead of stepping it (what the drafts comparison guards).
REMATCH_TOKENS = 32
CORES = ["reference", "native"]


def core_of(kind, prefetch=None):
    drafter = DrafterConfig(max_draft=K, stop_tokens=(EOS,), rematch_tokens=REMATCH_TOKENS)
    config = (HistoryConfig(prompt_tail=2), drafter, prefetch or PrefetchConfig(budget=0))
    if kind == "reference":
        return ReferenceCore(*config)
    pytest.importorskip("ngramrl._native", reason="the native core is not built (pip install . builds it)")
    return make_core(*config, threads=2, native=True)


@pytest.mark.parametrize("kind", CORES)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_outputs_and_drafts_identical_with_prefetch_off_on_and_cancelled(kind, temperature):
    table = toy_model()
    reference, drafts, _ = decode(core_of(kind), table, PROMPTS, temperature)
    assert sum(len(d.tokens) for step in drafts for d in step) > 0, "the drafter must draft for this to mean anything"
    configs = [(PrefetchConfig(budget=b, share_budget=False, max_budget=0), False) for b in (1, 4, 16)]
    configs += [(PrefetchConfig(budget=4), False), (PrefetchConfig(budget=16, global_budget=5), False),
                (PrefetchConfig(budget=16), True)]
    hits = 0
    for config, cancel_at_once in configs:
        outputs, steps, served = decode(core_of(kind, config), table, PROMPTS, temperature, prefetch=True,
                                        cancel_at_once=cancel_at_once)
        assert outputs == reference, (config, cancel_at_once)
        assert steps == drafts, (config, cancel_at_once)
        hits += served
    assert hits > 0, "some drafts must be served from the prefetch"


@pytest.mark.parametrize("kind", CORES)
def test_greedy_outputs_equal_plain_decoding(kind):
    table = toy_model(3)
    outputs, _, _ = decode(core_of(kind, PrefetchConfig(budget=4)), table, PROMPTS, 0.0, prefetch=True)
    for pid, prompt in PROMPTS.items():
        assert outputs[pid] == plain_rollout(table, prompt, 0.0, 0, 40)


def first_draft(seed, temperature, prompt_id, path_width=1):
    """A drafter warmed on the toy model's rollouts, and the first draft of a new request."""
    history = warm(RolloutHistory(HistoryConfig(prompt_tail=2)), toy_model(seed), PROMPTS, temperature)
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
