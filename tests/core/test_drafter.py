import pytest

from ngramrl.config import DrafterConfig, HistoryConfig
from ngramrl.core.drafter import NgramDrafter
from ngramrl.core.history import RolloutHistory

PROMPT = [1, 2, 3]


def feed(drafter, request, tokens):
    """Commit tokens one step at a time, drafting in between, as decoding does."""
    for token in tokens:
        drafter.commit(request, [token])
        drafter.propose(request)


def make(history_config=None, **drafter):
    history = RolloutHistory(history_config or HistoryConfig(prompt_tail=2))
    return history, NgramDrafter(history, DrafterConfig(**drafter))


def test_drafts_the_most_frequent_continuation_of_the_longest_match():
    history, drafter = make()
    history.add_rollout("p", PROMPT, [10, 11, 12, 13, 14], epoch=0)
    history.add_rollout("p", PROMPT, [10, 11, 12, 20, 21], epoch=0)
    history.add_rollout("p", PROMPT, [10, 11, 12, 13, 15], epoch=0)
    request = drafter.start("r", "p", PROMPT)
    draft = drafter.propose(request, 16)
    assert draft.tokens[:4] == [10, 11, 12, 13]
    assert draft.source == "prompt"
    assert len(draft.probs) == len(draft.tokens) and all(0 < p <= 1 for p in draft.probs)
    assert draft.probs[3] < draft.probs[1]  # 13 followed 2 of 3 times, 11 always followed 10
    drafter.commit(request, [10, 11, 12, 20])
    assert drafter.propose(request, 16).tokens == [21]
    drafter.commit(request, [30])
    assert drafter.propose(request, 16).tokens == []  # nothing ever followed token 30


def test_k_bounds_the_draft_and_zero_k_gives_nothing():
    history, drafter = make()
    history.add_rollout("p", PROMPT, list(range(10, 40)), epoch=0)
    request = drafter.start("r", "p", PROMPT)
    assert drafter.propose(request, 5).tokens == [10, 11, 12, 13, 14]
    assert drafter.propose(request, 0).tokens == []


def test_unregistered_unknown_prompt_gets_an_empty_draft_and_leaves_nothing():
    history, drafter = make()
    history.add_rollout("p", PROMPT, [10, 11], epoch=0)
    request = drafter.start("r", "never-seen", PROMPT, register=False)
    assert drafter.propose(request).tokens == []
    drafter.commit(request, [10, 11])
    assert drafter.propose(request).tokens == []
    drafter.finish(request, epoch=0)
    assert "never-seen" not in history


def test_the_readme_example_drafts_for_a_new_prompt_and_learns_its_rollouts():
    """The natural calls: start a request of a prompt never seen, commit, finish with an epoch.
    It drafts from its own output at once, and its rollout serves the prompt's next request."""
    history, drafter = make(use_global=False)
    request = drafter.start("q17/sample0", "q17", PROMPT)
    output = [10, 11, 12, 13, 10, 11, 12, 13, 2]
    for token in output[:5]:
        drafter.propose(request)
        drafter.commit(request, [token])
    assert drafter.propose(request).tokens[:3] == [11, 12, 13]  # its own output repeats
    drafter.commit(request, output[5:])
    drafter.finish(request, epoch=0)
    assert history.rollout_count("q17") == 1
    sibling = drafter.start("q17/sample1", "q17", PROMPT)
    assert drafter.propose(sibling, 4).tokens == [10, 11, 12, 13]  # the first rollout is history now


@pytest.mark.parametrize("call, message", [
    (lambda d, r: d.start("r", "p", PROMPT), "request id 'r' is already in flight"),
    (lambda d, r: d.start("s", "p", [1, "2"]), r"prompt\[1\] is not an integer token id: '2'"),
    (lambda d, r: d.start("s", "p", [1, -3]), r"prompt\[1\] = -3 is negative"),
    (lambda d, r: d.start("s", "p", [1, 2.5]), r"prompt\[1\] is not an integer token id: 2.5"),
    (lambda d, r: d.start("s", "p", 7), "prompt must be a sequence of token ids"),
    (lambda d, r: d.commit(r, [4, -1]), r"committed tokens\[1\] = -1 is negative"),
    (lambda d, r: d.commit(r, 4), "committed tokens must be a sequence of token ids"),
    (lambda d, r: d.defer(r, [None]), r"committed tokens\[0\] is not an integer token id"),
    (lambda d, r: d.finish(r, epoch=-1), "epoch must be an integer >= 0"),
    (lambda d, r: d.history.add_rollout("p", PROMPT, [1, True], 0), r"output\[1\] is not a token id"),
    (lambda d, r: d.history.add_rollout("p", PROMPT, [1], epoch="1"), "epoch must be an integer >= 0"),
])
def test_misuse_gets_a_clear_error(call, message):
    history, drafter = make()
    history.add_rollout("p", PROMPT, [10, 11], epoch=0)
    request = drafter.start("r", "p", PROMPT)
    with pytest.raises(ValueError, match=message):
        call(drafter, request)


def test_numpy_token_ids_are_taken_and_a_finished_id_may_be_reused():
    np = pytest.importorskip("numpy")
    history, drafter = make()
    request = drafter.start("r", "p", np.array(PROMPT))
    drafter.commit(request, np.array([10, 11]))
    assert request.output == [10, 11] and all(type(t) is int for t in request.prompt + request.output)
    drafter.finish(request, epoch=0)
    drafter.finish(drafter.start("r", "p", PROMPT))  # the id is free again once finished


def test_own_output_loop_is_continued_cyclically():
    history, drafter = make()
    history.add_rollout("p", PROMPT, [99], epoch=0)
    request = drafter.start("r", "p", PROMPT)
    feed(drafter, request, [50, 51, 52, 50, 51])
    assert drafter.propose(request, 7).tokens == [52, 50, 51, 52, 50, 51, 52]


def test_siblings_in_flight_share_their_tokens():
    history, drafter = make()
    history.add_rollout("p", PROMPT, [7], epoch=0)
    first = drafter.start("a", "p", PROMPT)
    second = drafter.start("b", "p", PROMPT)
    feed(drafter, first, [40, 41, 42, 43])
    drafter.commit(second, [40])
    assert drafter.propose(second, 3).tokens == [41, 42, 43]


def test_stop_tokens_end_the_draft():
    history, drafter = make(stop_tokens=(2,))
    history.add_rollout("p", PROMPT, [10, 2], epoch=0)
    request = drafter.start("r", "p", PROMPT)
    assert drafter.propose(request, 8).tokens == [10, 2]


def test_min_confidence_shortens_uncertain_drafts():
    history, drafter = make(min_confidence=0.3)
    for tail in ([13, 14], [20, 21], [30, 31]):
        history.add_rollout("p", PROMPT, [10, 11, 12] + tail, epoch=0)
    request = drafter.start("r", "p", PROMPT)
    assert drafter.propose(request, 8).tokens == [10, 11, 12]


def test_incremental_state_matches_a_fresh_request():
    history, drafter = make()
    outputs = [[10, 11, 12, 13, 14, 15, 16], [10, 11, 20, 13, 14, 21], [10, 30, 12, 13, 14, 15, 31]]
    for output in outputs:
        history.add_rollout("p", PROMPT, output, epoch=0)
    running = drafter.start("run", "p", PROMPT)
    target = [10, 11, 12, 13, 14, 21, 13, 14]
    for i, token in enumerate(target):
        fresh = drafter.start(f"fresh{i}", "p", PROMPT, output=target[:i])
        assert drafter.propose(fresh, 6).tokens == drafter.propose(running, 6).tokens
        drafter.finish(fresh)
        drafter.commit(running, [token])


def test_window_keeps_recent_rollouts_and_epochs():
    history, drafter = make(HistoryConfig(rollouts_per_prompt=2, epochs_kept=2, prompt_tail=2))
    history.add_rollout("p", PROMPT, [10, 11], epoch=0)
    history.add_rollout("p", PROMPT, [10, 12], epoch=0)
    history.add_rollout("p", PROMPT, [10, 13], epoch=1)
    assert history.rollout_count("p") == 2
    request = drafter.start("r", "p", PROMPT)
    drafter.commit(request, [10])
    assert drafter.propose(request, 1).tokens == [13]  # newest wins the 1-1 tie; [10, 11] was evicted
    drafter.finish(request)
    history.add_rollout("p", PROMPT, [10, 14], epoch=2)  # epoch 0 falls out of a 2-epoch window
    history.add_rollout("p", PROMPT, [10, 14], epoch=2)
    request = drafter.start("r2", "p", PROMPT)
    drafter.commit(request, [10])
    assert drafter.propose(request, 1).tokens == [14]
    assert history.rollout_count("p") == 2


def test_global_token_cap_evicts_least_recently_used_prompts():
    history, drafter = make(HistoryConfig(max_tokens=30, prompt_tail=2))
    history.add_rollout("old", PROMPT, [10] * 10, epoch=0)
    history.add_rollout("mid", PROMPT, [11] * 10, epoch=0)
    drafter.propose(drafter.start("touch", "old", PROMPT))  # "old" becomes the most recently used
    history.add_rollout("new", PROMPT, [12] * 10, epoch=0)
    assert history.stored_tokens <= 30
    assert "mid" not in history and "old" in history and "new" in history
    assert history.evicted_prompts == 1
    request = drafter.start("r", "mid", PROMPT, register=False)  # evicted: decodes on with empty drafts
    assert drafter.propose(request).tokens == []


def test_discarded_request_is_not_visible_afterwards():
    history, drafter = make(use_global=False)
    history.add_rollout("p", PROMPT, [10, 11], epoch=0)
    request = drafter.start("r", "p", PROMPT)
    drafter.commit(request, [10, 50, 51, 52])
    drafter.finish(request)  # dropped, not kept
    other = drafter.start("s", "p", PROMPT)
    drafter.commit(other, [50])
    assert drafter.propose(other).tokens == []
    kept = drafter.start("t", "p", PROMPT)
    drafter.commit(kept, [10, 60, 61])
    drafter.finish(kept, epoch=1)
    assert history.rollout_count("p") == 2
    again = drafter.start("u", "p", PROMPT)
    drafter.commit(again, [60])
    assert drafter.propose(again).tokens == [61]


def test_other_prompts_draft_where_this_prompt_has_no_evidence():
    history, drafter = make()
    history.add_rollout("p", PROMPT, [10, 11], epoch=0)
    history.add_rollout("q", [7, 8, 9], [40, 41, 42, 43, 44], epoch=0)
    request = drafter.start("r", "p", PROMPT)
    drafter.commit(request, [40, 41])
    draft = drafter.propose(request, 4)
    assert draft.tokens == [42, 43, 44] and draft.source == "global"


def test_cross_prompt_index_is_rebuilt_rarely_as_windows_move_on():
    """Every new epoch evicts each prompt's oldest rollouts. Rebuilding the cross-prompt index at
    each eviction would cost the whole history every time; it is rebuilt only once evicted
    rollouts are half of it, and then holds nothing evicted."""
    history = RolloutHistory(HistoryConfig(rollouts_per_prompt=2, epochs_kept=1, prompt_tail=0))
    prompts = {f"p{i}": [i] for i in range(20)}
    adds = 0
    for epoch in range(12):
        for pid, prompt in prompts.items():
            history.add_rollout(pid, prompt, [100 + epoch, 200 + int(pid[1:]), 300 + epoch], epoch=epoch)
            history.global_index()  # a lookup after each finished rollout, as in the engine
            adds += 1
    assert history.global_builds <= 12  # against one per eviction (220) if rebuilt every time
    history._global = None  # noqa: SLF001 - a fresh build holds the current window only
    fresh = history.global_index()
    assert fresh.match([100 + 11])[1] == 1 and fresh.match([100 + 5])[1] == 0


def test_a_stale_cross_prompt_index_is_replaced_while_rollouts_are_stored_never_by_a_lookup():
    """Once evicted rollouts are half of the cross-prompt index, its replacement over the windows is
    built a few rollouts at a time as rollouts are stored, while the old one serves: a lookup never
    builds it (the whole window's build would land on one engine step), and the replacement holds
    nothing that had left the windows when it started."""
    history = RolloutHistory(HistoryConfig(epochs_kept=1, prompt_tail=0))
    prompts = {f"p{i}": [i] for i in range(20)}
    for pid, prompt in prompts.items():
        history.add_rollout(pid, prompt, [1000] + [int(pid[1:])] * 9, epoch=0)
    in_use = history.global_index()  # the first build is at a lookup: nothing was there to serve
    replaced, served_while_building = [], 0
    for epoch in (1, 2, 3):
        for pid, prompt in prompts.items():
            history.add_rollout(pid, prompt, [1000 + epoch] + [int(pid[1:])] * 9, epoch=epoch)
            builds = history.global_builds
            index = history.global_index()
            assert history.global_builds == builds, "a lookup built the cross-prompt index"
            served_while_building += getattr(history, "_next_global", None) is not None
            if index is not in_use:
                replaced.append((epoch, index))
                in_use = index
    assert len(replaced) >= 2 and served_while_building >= 4, (replaced, served_while_building)
    for epoch, index in replaced:  # what had left every window before the replacement started
        assert index.match([1000 + epoch - 2])[1] == 0
        assert index.match([1000 + epoch])[1] == 1


def test_outcome_sources_are_the_prompt_index_then_the_cross_prompt_one():
    history, drafter = make()
    history.add_rollout("p", PROMPT, [10, 11], epoch=0)
    history.add_rollout("q", [7, 8, 9], [40, 41, 42], epoch=0)
    request = drafter.start("r", "p", PROMPT)
    drafter.commit(request, [40])
    drafter.propose(request, 4)
    sources = drafter.outcome_sources(request)
    assert [index for index, _ in sources] == [history.index_of("p"), history.global_index()]
    assert drafter.outcome_sources(drafter.start("x", "unknown", [5], register=False)) == []


@pytest.mark.parametrize("bad, message", [
    (dict(max_draft=-1), "max_draft must be >= 0"), (dict(min_confidence=1.5), "min_confidence"),
    (dict(min_match=0), "min_match"), (dict(stop_tokens=2), "stop_tokens must be a list of integers, got 2"),
    (dict(stop_tokens="2"), "stop_tokens must be a list of integers"), (dict(stop_tokens=[2, -1]), "token ids >= 0"),
    (dict(max_draft="16"), "max_draft must be an integer, got '16'"), (dict(use_global="no"), "true or false"),
    (dict(levels=0), "levels and path_width must be >= 1"), (dict(path_width=0), "levels and path_width must be >= 1"),
    (dict(min_confidence=float("nan")), "DrafterConfig.min_confidence must be a finite number, got nan")])
def test_config_rejects_bad_values(bad, message):
    with pytest.raises(ValueError, match=message):
        DrafterConfig(**bad)


def test_config_takes_any_sequence_of_stop_tokens():
    assert DrafterConfig(stop_tokens=[2, 7]).stop_tokens == (2, 7)


def test_every_core_config_refuses_nan_and_infinity():
    """The engines read their configuration from NGRAMRL_CONFIG (JSON allows NaN): a NaN passes
    every range check, so each float field is checked to be finite."""
    from ngramrl.config import EngineConfig, PrefetchConfig

    for config_class, name in ((PrefetchConfig, "prior_strength"), (EngineConfig, "min_gain"),
                               (PrefetchConfig, "calibration_decay")):
        for value in (float("nan"), float("inf")):
            with pytest.raises(ValueError, match=f"{config_class.__name__}.{name} must be a finite number"):
                config_class(**{name: value})


def test_history_config_rejects_bad_values():
    with pytest.raises(ValueError, match="rollouts_per_prompt"):
        HistoryConfig(rollouts_per_prompt=0)


def test_a_prompt_evicted_while_its_request_runs_stops_drafting_without_error():
    history, drafter = make(HistoryConfig(max_tokens=30, prompt_tail=2))
    history.add_rollout("p", PROMPT, [10, 11, 12], epoch=0)
    request = drafter.start("r", "p", PROMPT)
    assert drafter.propose(request).tokens
    history.add_rollout("q", PROMPT, list(range(40, 70)), epoch=0)  # evicts "p"
    assert "p" not in history
    drafter.commit(request, [10])
    assert drafter.propose(request).tokens == []
    drafter.finish(request, epoch=1)


def test_steps_without_lookups_leave_the_next_draft_unchanged():
    """Match states are stepped only when a lookup needs them (a request that is not drafted
    pays only for the index insert): drafting after steps without lookups gives what drafting
    every step gives, from both the prompt's and the cross-prompt index."""
    import random

    drafts = {}
    for lazy in (False, True):
        rng = random.Random(3)
        history, drafter = make()
        for p in range(3):
            for _ in range(3):
                history.add_rollout(f"p{p}", PROMPT, [rng.randrange(10, 16) for _ in range(60)], epoch=0)
        rng.seed(4)
        request = drafter.start("r", "p0", PROMPT, register=True)
        made = []
        for step in range(80):
            drafter.commit(request, [rng.randrange(10, 16) for _ in range(rng.randrange(1, 4))])
            if lazy and step % 7 != 6:  # lazy: a lookup every 7th step only
                made.append(None)
                continue
            made.append(drafter.lookup(request, 8))
            index = history.index_of("p0")  # the match state is the longest suffix of the context it holds
            assert (request.match.state, request.match.matched) == index.match(request.prompt + request.output)
            drafter.absorb(request)
        drafts[lazy] = made
    for eager, lazy in zip(drafts[False], drafts[True], strict=True):
        if lazy is not None:
            assert (lazy.tokens, lazy.source, lazy.matched) == (eager.tokens, eager.source, eager.matched)
    assert sum(d is not None and bool(d.tokens) for d in drafts[True]) >= 5


def test_a_split_longest_context_is_decided_by_the_shorter_ones():
    """After [5, 6] this prompt saw 7 and 8 once each (the newest, 8, would win a tie); after [6]
    alone, 7 many times: the interpolated estimate drafts 7."""
    history, drafter = make(use_global=False)
    history.add_rollout("p", PROMPT, [5, 6, 7, 1, 6, 7, 1, 6, 7, 1, 6, 7], epoch=0)
    history.add_rollout("p", PROMPT, [5, 6, 8], epoch=0)
    request = drafter.start("r", "p", PROMPT)
    drafter.commit(request, [5, 6])
    draft = drafter.propose(request, 1)
    assert draft.tokens == [7]
    assert 0.5 < draft.probs[0] < 1


def test_this_prompt_comes_before_a_longer_match_in_other_prompts():
    history, drafter = make()
    history.add_rollout("p", PROMPT, [40, 41, 50, 51], epoch=0)
    for _ in range(3):
        history.add_rollout("q", [7, 8, 9], [30, 40, 41, 42, 43], epoch=0)
    request = drafter.start("r", "p", PROMPT)
    drafter.commit(request, [30, 40, 41])
    draft = drafter.propose(request, 2)
    assert draft.tokens == [50, 51] and draft.source == "prompt"
    assert draft.matched == 2  # [40, 41] in this prompt's index, against 3 tokens in the other prompts'


def test_path_width_chooses_the_path_of_largest_expected_accepted_length():
    """The likeliest first token (10, three of five) leads nowhere certain; the other (20) starts a
    path seen twice the same way: with two paths compared the chain takes 20's."""
    tails = [[10, 31], [10, 32], [10, 33], [20, 21, 22, 23, 24, 25], [20, 21, 22, 23, 24, 25]]
    drafts = {}
    for width in (1, 2):
        history, drafter = make(use_global=False, path_width=width)
        for tail in tails:
            history.add_rollout("p", PROMPT, [5] + tail, epoch=0)
        request = drafter.start("r", "p", PROMPT)
        drafter.commit(request, [5])
        drafts[width] = drafter.propose(request, 6)
    assert drafts[1].tokens[0] == 10
    assert drafts[2].tokens == [20, 21, 22, 23, 24, 25]
    assert drafts[2].expected_accepted > drafts[1].expected_accepted


def test_lookup_tree_holds_the_alternatives_the_chain_leaves_out():
    history, drafter = make(use_global=False)
    for tail in ([10, 11, 12], [10, 11, 12], [20, 21, 22]):
        history.add_rollout("p", PROMPT, [5] + tail, epoch=0)
    request = drafter.start("r", "p", PROMPT)
    drafter.commit(request, [5])
    chain = drafter.lookup(request, 4)
    tree = drafter.lookup_tree(request, 6, 2)
    assert chain.tokens[:3] == [10, 11, 12]
    assert [tree.tokens[i] for i in tree.children(-1)] == [10, 20]
    assert tree.accept([20, 21, 22, 9]) and len(tree.accept([20, 21, 22, 9])) == 3 - (len(tree) < 6)
    assert len(tree) == 6 and len(tree.leaves()) == 2
    assert drafter.lookup_tree(request, 0, 2).tokens == []
    assert drafter.lookup_tree(drafter.start("x", "unknown", [5]), 6, 2).tokens == []
