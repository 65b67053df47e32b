import pytest

from ngramrl.core.automaton import SuffixAutomaton
from ngramrl.core.estimate import MatchState, continuation_estimates


def source(sequences, context):
    index = SuffixAutomaton()
    for sequence in sequences:
        index.add_sequence(sequence)
    return index, MatchState(*index.match(context))


def test_witten_bell_interpolates_the_suffix_levels_longest_first():
    # After [1, 2]: 3 twice, 4 once (followed 3, distinct 2). After [2] alone also 5 once (from [9, 2]).
    prompt = source([[1, 2, 3], [1, 2, 3], [1, 2, 4], [9, 2, 5]], [1, 2])
    estimates = dict((t, p) for p, t in continuation_estimates([prompt], levels=2, limit=10, min_length=1))
    # level [1, 2]: 3 -> 2/5, 4 -> 1/5, escape 2/5; level [2]: 3 -> 2/7, 4 -> 1/7, 5 -> 1/7 of the escape
    assert estimates[3] == pytest.approx(2 / 5 + 2 / 5 * 2 / 7)
    assert estimates[4] == pytest.approx(1 / 5 + 2 / 5 * 1 / 7)
    assert estimates[5] == pytest.approx(2 / 5 * 1 / 7)
    one_level = dict((t, p) for p, t in continuation_estimates([prompt], levels=1, limit=10, min_length=1))
    assert set(one_level) == {3, 4}


def test_exclusion_conditions_every_level_on_the_token_not_following():
    prompt = source([[1, 2, 3], [1, 2, 3], [1, 2, 4]], [1, 2])
    estimates = dict((t, p) for p, t in continuation_estimates([prompt], 1, 10, exclude=3, min_length=1))
    assert set(estimates) == {4}
    assert estimates[4] == pytest.approx(1 / (3 + 2 - 2))  # followed 3 + distinct 2, without 3's count


def test_the_second_source_gets_only_the_mass_the_first_leaves():
    prompt = source([[1, 2, 3]], [1, 2])
    other = source([[1, 2, 7], [1, 2, 7], [1, 2, 7], [5, 2, 7]], [1, 2])
    estimates = continuation_estimates([prompt, other], levels=1, limit=10, min_length=1)
    assert estimates[0][1] == 3  # this prompt's evidence first, even against more of the other's
    assert dict((t, p) for p, t in estimates)[7] == pytest.approx(1 / 2 * 3 / 4)
    reverse = continuation_estimates([other, prompt], levels=1, limit=10, min_length=1)
    assert reverse[0][1] == 7


def test_min_length_keeps_the_empty_context_out_and_limit_cuts():
    prompt = source([[1, 2, 3], [4, 5, 6]], [8])  # nothing matches [8]
    assert continuation_estimates([prompt], 3, 10, min_length=1) == []
    everything = continuation_estimates([prompt], 3, 10, min_length=0)
    assert {t for _, t in everything} == {1, 2, 3, 4, 5, 6}  # every token seen
    assert len(continuation_estimates([prompt], 3, 2, min_length=0)) == 2


def test_ties_go_to_the_newest_continuation_of_the_longest_context():
    prompt = source([[1, 2, 3], [1, 2, 4]], [1, 2])
    assert continuation_estimates([prompt], 3, 2, min_length=1)[0][1] == 4
    prompt = source([[1, 2, 4], [1, 2, 3]], [1, 2])
    assert continuation_estimates([prompt], 3, 2, min_length=1)[0][1] == 3
