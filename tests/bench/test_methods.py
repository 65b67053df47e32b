import random

import pytest

from ngramrl.bench.methods import METHOD_NAMES, make_method, prompt_lookup
from ngramrl.bench.replay import replay
from ngramrl.config import PrefetchConfig
from ngramrl.core.trace import Rollout, Trace, TraceHeader


def reference_prompt_lookup(tokens, min_n, max_n, k):
    """Longest suffix n-gram seen earlier, earliest occurrence, tokens after it (never past the end)."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        pattern = tokens[-n:]
        for start in range(0, len(tokens) - n):
            if tokens[start:start + n] == pattern:
                return tokens[start + n:start + n + k]
    return []


def test_prompt_lookup_matches_the_reference_definition():
    rng = random.Random(1)
    for _ in range(3000):
        tokens = [rng.randint(0, 3) for _ in range(rng.randint(0, 25))]
        k = rng.randint(1, 6)
        assert prompt_lookup(tokens, 2, 5, k) == reference_prompt_lookup(tokens, 2, 5, k), tokens


def toy_trace(rollouts):
    return Trace(TraceHeader(vocab_size=1000, eos_token_ids=[2], workload="toy"), rollouts, "toy.jsonl")


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_no_rollout_of_the_same_epoch_is_visible(name):
    prompt = [1, 5, 6]
    same = list(range(300, 340))  # every epoch-1 sample is identical, and new
    rollouts = [Rollout("a", 0, 0, prompt, list(range(100, 120)))]
    rollouts += [Rollout("a", 1, s, prompt, same) for s in range(3)]
    result = replay(toy_trace(rollouts), make_method(name), 8)
    assert result.rollouts == 3
    assert result.forwards == result.tokens == 3 * len(same)


@pytest.mark.parametrize("name", ["ngramrl", "suffix", "oracle"])
def test_earlier_epochs_are_visible_and_later_ones_are_not(name):
    prompt = [1, 5, 6]
    output = list(range(300, 340))
    rollouts = [Rollout("a", 0, 0, prompt, list(range(100, 110))), Rollout("a", 1, 0, prompt, output),
                Rollout("a", 2, 0, prompt, output)]
    steps = {1: 0, 2: 0}

    def count(draft, accepted, rollout, position):
        steps[rollout.epoch] += 1

    replay(toy_trace(rollouts), make_method(name), 8, on_step=count)
    assert steps[1] == len(output)  # epoch 2 had not happened yet
    assert steps[2] < len(output) / 3  # epoch 1 is history now


def test_replay_is_deterministic_and_oracle_is_a_ceiling():
    rng = random.Random(3)
    prompts = {f"p{i}": [1, 2, 3 + i] for i in range(3)}
    rollouts = []
    for epoch in range(3):
        for pid, prompt in prompts.items():
            for sample in range(3):
                base = [10 + int(pid[1:]), 11, 12, 13, 14, 15, 16, 17, 18]
                rollouts.append(Rollout(pid, epoch, sample, prompt,
                                        [t if rng.random() > 0.2 else rng.randint(20, 30) for t in base] + [2]))
    trace = toy_trace(rollouts)
    results = {name: replay(trace, make_method(name), 8) for name in METHOD_NAMES}
    again = replay(trace, make_method("ngramrl"), 8)
    assert again.forwards == results["ngramrl"].forwards
    for name in METHOD_NAMES:
        assert results[name].tokens == results["none"].tokens
        if name != "ngramrl-tree":  # a single path's ceiling: a tree may pass it
            assert results["oracle"].tokens_per_forward >= results[name].tokens_per_forward
    assert results["none"].tokens_per_forward == 1.0
    assert results["ngramrl"].tokens_per_forward > 1.5
    assert results["ngramrl-tree"].tokens_per_forward >= results["ngramrl"].tokens_per_forward


def test_unknown_method_is_rejected():
    with pytest.raises(ValueError, match="unknown method"):
        make_method("eagle")


@pytest.mark.parametrize("native", [False, True], ids=["reference-core", "native-core"])
def test_replay_with_prefetch_uses_the_same_drafts(native):
    """Prefetched next drafts are the drafts the ordinary lookup makes: same forwards, with hits;
    and a step's draft came from the prefetch exactly when its outcome was among those looked up."""
    from ngramrl.bench.methods import NgramRLMethod

    if native:
        pytest.importorskip("ngramrl._native")
    rng = random.Random(5)
    prompts = {f"p{i}": [1, 2, 3 + i] for i in range(3)}
    rollouts = [Rollout(pid, epoch, sample, prompt, [rng.choice([10, 11, 12, 13]) for _ in range(30)] + [2])
                for epoch in range(3) for pid, prompt in prompts.items() for sample in range(3)]
    trace = toy_trace(rollouts)
    plain = replay(trace, NgramRLMethod(native=native), 8)
    for budget in (1, 16):
        prefetching = NgramRLMethod(prefetch=PrefetchConfig(budget=budget), budgets=[1, budget], native=native)
        assert prefetching.core.native == native
        result = replay(trace, prefetching, 8)
        assert result.forwards == plain.forwards
        tally = prefetching.tally
        assert tally.prefetch_hits == tally.hits.get(budget, 0) > 0
        assert tally.value(budget) >= tally.value(1) > 0


def test_the_benchmark_drafts_with_the_core_engines_run_and_the_reference_agrees():
    """`ngramrl bench` replays ngramrl through the drafting core vLLM's proposer runs (the native
    one where built): on a shipped trace its forwards and its coverage at every budget are the
    Python reference core's, and its forwards and scored steps those of the reference drafter."""
    pytest.importorskip("ngramrl._native")
    from ngramrl.bench.methods import NgramRLMethod, ReferenceMethod
    from ngramrl.bench.run import builtin_traces, drafter_for
    from ngramrl.config import DrafterConfig
    from ngramrl.core.trace import read_trace

    whole = read_trace(next(p for p in builtin_traces() if "bfcl-smollm2-t0.6" in p))
    prompts = sorted({r.prompt_id for r in whole.rollouts})[:4]
    trace = Trace(whole.header, [r for r in whole.rollouts if r.prompt_id in prompts and r.epoch <= 1], whole.path)
    drafter = drafter_for(trace, DrafterConfig())
    assert make_method("ngramrl").core.native
    runs = {}
    for native in (True, False):
        method = NgramRLMethod(drafter=drafter, prefetch=PrefetchConfig(budget=8), budgets=[1, 2, 8], native=native)
        runs[native] = (replay(trace, method, 16).forwards, method.tally.hits, method.tally.ceiling_hits,
                        method.tally.prefetch_hits, method.tally.steps)
    assert runs[True] == runs[False]
    assert runs[True][1][8] > runs[True][1][1] > 0
    reference = ReferenceMethod(drafter=drafter, prefetch=PrefetchConfig(budget=8), budgets=[8])
    assert replay(trace, reference, 16).forwards == runs[True][0]
    # the same steps scored (each rollout's prefill verifies no draft) against the same ceiling
    assert (reference.tally.steps, reference.tally.ceiling_hits) == (runs[True][4], runs[True][2])


def test_knowing_j_covers_at_least_what_the_outcome_model_covers():
    """An outcome among the top B overall has its b among the top B at its own j: the known-j
    figure bounds coverage at the same budget from above (and is below 1 when b is uncertain)."""
    from ngramrl.bench.methods import ReferenceMethod

    rng = random.Random(6)
    prompts = {f"p{i}": [1, 2, 3 + i] for i in range(3)}
    rollouts = [Rollout(pid, epoch, sample, prompt, [rng.choice(range(10, 22)) for _ in range(40)] + [2])
                for epoch in range(3) for pid, prompt in prompts.items() for sample in range(3)]
    for budget in (1, 4):
        method = ReferenceMethod(budgets=[budget], known_j_budget=budget)
        replay(toy_trace(rollouts), method, 8)
        tally = method.tally
        assert tally.hits.get(budget, 0) <= tally.known_j_hits < tally.steps
        assert tally.known_j_hits > 0


def test_tree_method_accepts_along_a_branch_the_chain_leaves_out():
    """Two earlier rollouts went one way and one the other after their first token; the replayed
    one takes the rarer way: the chain drafts the frequent way and loses the step, a tree of two
    paths keeps both."""
    from ngramrl.bench.methods import NgramRLTreeMethod

    prompt = [1, 5, 6]
    frequent, rare = [9, 10, 11, 12, 13, 14, 2], [9, 20, 21, 22, 23, 24, 2]
    rollouts = [Rollout("a", 0, s, prompt, out) for s, out in enumerate([frequent, frequent, rare])]
    rollouts.append(Rollout("a", 1, 0, prompt, rare))
    trace = toy_trace(rollouts)
    chain = replay(trace, make_method("ngramrl"), 16)
    accepted = []
    tree = replay(trace, NgramRLTreeMethod(width=2), 16, on_step=lambda d, a, r, p: accepted.append(a))
    # the prefill's forward samples 9 (no draft is verified with it); then the rest is one root
    # path of the tree
    assert chain.forwards > tree.forwards == 2
    assert accepted == [0, len(rare) - 1]
    single = replay(trace, NgramRLTreeMethod(width=1), 16)
    assert single.forwards == chain.forwards  # a tree of one path is the chain


def test_known_j_counts_b_among_the_likeliest_tokens_after_the_true_j():
    """After [10] the history saw 11 three times, 12 twice, 13 once; the replayed rollout rejects
    11 and emits 13: the second likeliest correction, so a budget of 2 covers it and 1 does not."""
    from ngramrl.bench.methods import ReferenceMethod

    prompt = [1, 5, 6]
    outputs = [[10, 11, 2]] * 3 + [[10, 12, 2]] * 2 + [[10, 13, 2]]
    rollouts = [Rollout("a", 0, s, prompt, out) for s, out in enumerate(outputs)]
    rollouts.append(Rollout("a", 1, 0, prompt, [10, 13, 2]))
    found = {}
    for budget in (1, 2):
        method = ReferenceMethod(budgets=[budget], known_j_budget=budget)
        replay(toy_trace(rollouts), method, 8)
        assert method.tally.steps == 1
        found[budget] = method.tally.known_j_hits
    assert found == {1: 0, 2: 1}


@pytest.mark.parametrize("name", ["ngramrl", "ngramrl-tree"])
def test_a_prompt_first_met_in_a_replayed_epoch_drafts_from_its_own_output_only(name):
    """A prompt no earlier epoch has drafts as in an engine, from its own output (a loop) and the
    other prompts' rollouts, and never from a sibling of its own epoch: two identical samples
    without repeats take a forward per token each, and a sample that loops drafts its loop."""
    plain = list(range(300, 340))
    loop = [400, 401, 402, 403] * 10
    rollouts = [Rollout("a", 0, 0, [1, 5, 6], list(range(100, 120)))]
    rollouts += [Rollout("new", 1, s, [1, 7, 8], out) for s, out in enumerate([plain, plain, loop])]
    per_rollout = []
    result = replay(toy_trace(rollouts), make_method(name), 8,
                    on_step=lambda d, a, r, p: per_rollout.append((r.sample, min(a + 1, len(r.output) - p))))
    steps = {s: sum(1 for sample, _ in per_rollout if sample == s) for s in range(3)}
    assert steps[0] == steps[1] == len(plain)  # nothing of sample 0 reached sample 1
    assert steps[2] < len(loop) / 2
    assert result.tokens == 2 * len(plain) + len(loop)


def test_tree_method_learns_acceptance_from_every_child_verification_reached():
    """After a verified tree, each child of the context and of every accepted node is one
    observation for the calibration (accepted or not at its depth); the trees that follow are
    grown on those chances."""
    from ngramrl.bench.methods import NgramRLTreeMethod
    from ngramrl.core.tree import ROOT_NODE

    prompt = [1, 5, 6]
    first, second = [10, 11, 12, 13, 14, 2], [10, 11, 22, 23, 24, 2]
    method = NgramRLTreeMethod(width=2)
    method.add_history([Rollout("a", 0, s, prompt, out) for s, out in enumerate([first, first, second])])
    method.start(Rollout("a", 1, 0, prompt, [10, 11, 30, 31]))
    method.commit([10])  # the first token: no tree yet
    tree = method.propose(16)
    assert tree.children(ROOT_NODE) and len(tree.leaves()) == 2  # 11, then 12 ... or 22 ...
    truth = [11, 30]  # 11 accepted, then the target emits 30: no child of 11 has it
    reached = [ROOT_NODE, tree.children(ROOT_NODE)[0]]
    expected = sum(len(tree.children(node)) for node in reached)
    method.commit(truth)
    cells = method.calibration.state()
    assert sum(trials for *_, trials in cells) == pytest.approx(expected, rel=0.02)  # (decay: 0.99 a repeat)
    assert sum(accepted for *_, accepted, _ in cells) == 1  # only 11 was accepted
    assert {int(bucket) for bucket, *_ in cells} == {0, 1}  # depth 0 (11), depth 1 (12 and 22)
    grown = []
    method.drafter.lookup_tree = lambda *args, **kwargs: grown.append(kwargs.get("chance")) or tree
    method.propose(16)
    assert grown == [method.calibration.chance]


@pytest.mark.parametrize("name", [n for n in METHOD_NAMES if n != "suffix"] + ["suffix"])
def test_the_first_token_comes_from_the_prefill_without_a_draft(name):
    """An engine samples a request's first token in its prefill's forward and drafts from a
    sampled token on (vLLM calls its proposer after that forward): even a rollout that repeats an
    earlier one word for word, which ngramrl could draft from its prompt, takes one forward for
    its first token."""
    if name == "suffix":
        pytest.importorskip("arctic_inference")
    prompt, output = [1, 5, 6], [10, 11, 12, 13, 14, 2]
    trace = toy_trace([Rollout("a", 0, 0, prompt, output), Rollout("a", 1, 0, prompt, output)])
    steps = []
    result = replay(trace, make_method(name), 16, on_step=lambda d, a, r, p: steps.append((p, d, a)))
    assert steps[0] == (0, [], 0)
    assert result.forwards >= 2 and result.accepted_hist[0] >= 1
    if name in ("ngramrl", "ngramrl-tree", "oracle", "oracle-prompt"):
        assert result.forwards == 2  # the rest, drafted from the earlier rollout, in one forward
        assert result.drafted == 5 and result.acceptance == 1.0 and result.drafted_per_forward == 2.5
    if name == "none":
        assert result.drafted == 0 and result.acceptance is None
