"""The fresh-prompts regime: a prompt's samples replayed concurrently, drafting from each other only."""

import pytest

from ngramrl.bench.siblings import SIBLING_METHODS, make_sibling_method, replay_siblings
from ngramrl.config import DrafterConfig
from ngramrl.core.trace import Rollout, Trace, TraceHeader


def toy_trace(rollouts):
    return Trace(TraceHeader(vocab_size=1000, eos_token_ids=[2], workload="toy"), rollouts, "toy.jsonl")


def group(prompt_id, epoch, prompt, outputs):
    return [Rollout(prompt_id, epoch, sample, prompt, output) for sample, output in enumerate(outputs)]


def test_a_sample_drafts_from_the_sibling_ahead_of_it():
    """The second sample says what the first said, thirty tokens later: ngramrl drafts it from
    what the first one committed (from the next step on) until it has caught up; prompt lookup and
    no drafting cannot."""
    shared = list(range(300, 360))
    rollouts = group("a", 0, [1, 5, 6], [shared, list(range(900, 930)) + shared])
    # (this prompt's index only: the cross-prompt fallback would also see the first once it finished)
    own_prompt = DrafterConfig(use_global=False)
    results = {name: replay_siblings(toy_trace(rollouts), make_sibling_method(name, own_prompt), 8)
               for name in ("ngramrl", "pld", "none")}
    assert results["none"].tokens_per_forward == 1.0
    assert results["pld"].tokens_per_forward == 1.0  # nothing repeats within one sample
    assert results["ngramrl"].forwards <= results["none"].forwards - 20
    assert all(r.tokens == 150 and r.rollouts == 2 for r in results.values())


@pytest.mark.parametrize("name", SIBLING_METHODS)
def test_nothing_crosses_from_one_prompt_epoch_to_another(name):
    """The same outputs under another prompt, or in a later epoch, draft nothing from an earlier group."""
    if name == "suffix":
        pytest.importorskip("arctic_inference")
    alone = toy_trace(group("b", 0, [1, 7, 8], [list(range(500, 540))]))
    after = toy_trace(group("a", 0, [1, 5, 6], [list(range(500, 540))]) +
                      group("a", 1, [1, 5, 6], [list(range(500, 540))]) + group("b", 0, [1, 7, 8],
                                                                                [list(range(500, 540))]))
    single = replay_siblings(alone, make_sibling_method(name), 8)
    combined = replay_siblings(after, make_sibling_method(name), 8)
    assert single.forwards == single.tokens == 40
    assert combined.forwards == 3 * 40


def test_suffix_drafts_from_a_running_sibling_and_more_once_it_has_finished():
    pytest.importorskip("arctic_inference")
    shared = list(range(300, 360))
    ahead = toy_trace(group("a", 0, [1, 5, 6], [shared[:40], list(range(900, 910)) + shared]))
    result = replay_siblings(ahead, make_sibling_method("suffix"), 8)
    # the second drafts the first's tokens as far as the first has gone (it leads by ten), then
    # all of them once it has finished (step 40): some help before, more after
    assert 40 + 40 < result.forwards < 40 + 70


@pytest.mark.parametrize("name", SIBLING_METHODS)
def test_every_samples_first_token_comes_from_the_prefill(name):
    """The first step verifies no draft for any sample (their first tokens come from the prefill)."""
    if name == "suffix":
        pytest.importorskip("arctic_inference")
    from ngramrl.core.trace import Rollout as R

    earlier = [R("b", 0, 0, [1, 5, 6], [10, 11, 12, 2])]  # another prompt's rollout, seen before
    trace = toy_trace(earlier + group("a", 1, [1, 5, 6], [[10, 11, 12, 2], [10, 11, 12, 2]]))
    result = replay_siblings(trace, make_sibling_method(name), 8)
    assert result.accepted_hist[0] >= 3 and result.forwards >= 2 + 1 + 2
