import random

import pytest

from ngramrl.core.automaton import SuffixAutomaton
from ngramrl.core.estimate import MatchState, continuation_estimates, step_sources
from ngramrl.core.tree import ROOT_NODE, DraftTree, choose_path, extend_path, grow_tree

LEVELS = 3


def random_sources(seed):
    rng = random.Random(seed)
    index = SuffixAutomaton()
    for _ in range(6):
        index.add_sequence([rng.choice([5, 6, 7, 8]) for _ in range(30)])
    context = [rng.choice([5, 6, 7, 8]) for _ in range(4)]
    return [(index, MatchState(*index.match(context)))]


def all_paths(sources, floor):
    """Every path whose probability is at least ``floor``, with that probability, by brute force
    (a child is never likelier than its parent, so nothing below the floor has a descendant above)."""
    out = {}
    frontier = [((), sources, 1.0)]
    while frontier:
        path, at, prob = frontier.pop()
        for p, token in continuation_estimates(at, LEVELS, 100, min_length=1):
            if prob * p >= floor:
                out[path + (token,)] = prob * p
                frontier.append((path + (token,), step_sources(at, token), prob * p))
    return out


def node_paths(tree):
    return [tuple(tree.tokens[i] for i in tree.path(node)) for node in range(len(tree))]


@pytest.mark.parametrize("seed", range(5))
def test_a_wide_tree_holds_the_likeliest_paths(seed):
    sources = random_sources(seed)
    size = 12
    tree, _ = grow_tree(sources, size, width=size, levels=LEVELS)
    cut = min(tree.path_probs)
    probs = all_paths(sources, cut * (1 - 1e-9))
    chosen = node_paths(tree)
    assert len(chosen) == size and len(set(chosen)) == size
    for path, prob in zip(chosen, tree.path_probs, strict=True):
        assert prob == pytest.approx(probs[path])
    assert all(probs[path] <= cut * (1 + 1e-9) for path in set(probs) - set(chosen))  # nothing likelier left out
    assert tree.expected_accepted == pytest.approx(sum(sorted(probs.values(), reverse=True)[:size]))


@pytest.mark.parametrize("seed", range(5))
def test_width_bounds_the_paths_and_width_one_is_the_greedy_chain(seed):
    sources = random_sources(seed)
    for width in (1, 2, 4):
        tree, _ = grow_tree(sources, 16, width, LEVELS)
        assert 1 <= len(tree.leaves()) <= width and len(tree) == 16
        assert all(parent < node for node, parent in enumerate(tree.parents))
    chain, _ = grow_tree(sources, 16, 1, LEVELS)
    tokens, probs = extend_path(sources, 1.0, 16, LEVELS)
    assert chain.tokens == tokens and chain.probs == pytest.approx(probs)
    assert chain.parents == list(range(-1, 15))
    assert choose_path(chain) == list(range(16))


def test_choose_path_takes_the_largest_expected_accepted_length():
    tree = DraftTree(tokens=[1, 2, 3, 4], parents=[ROOT_NODE, ROOT_NODE, 1, 2], probs=[0.6, 0.4, 0.9, 0.9],
                     path_probs=[0.6, 0.4, 0.36, 0.324])
    assert choose_path(tree) == [1, 2, 3]  # 0.4 + 0.36 + 0.324 beats 0.6
    assert choose_path(DraftTree()) == []


def test_accept_follows_the_longest_matching_root_path():
    tree = DraftTree(tokens=[1, 2, 3, 4, 5], parents=[ROOT_NODE, ROOT_NODE, 0, 1, 3],
                     probs=[0.5] * 5, path_probs=[0.5] * 5)
    assert tree.accept([2, 4, 5, 9]) == [1, 3, 4]
    assert tree.accept([1, 3, 3]) == [0, 2]
    assert tree.accept([7]) == []
    assert tree.children(ROOT_NODE) == [0, 1] and tree.children(1) == [3]


def test_stop_tokens_end_a_branch_and_floor_stops_growth():
    index = SuffixAutomaton()
    for tail in ([2], [3, 4, 5], [3, 4, 6]):
        index.add_sequence([1] + tail)
    sources = [(index, MatchState(*index.match([1])))]
    tree, _ = grow_tree(sources, 10, 4, LEVELS, stops={2})
    stop = tree.tokens.index(2)
    assert tree.children(stop) == []
    shallow, _ = grow_tree(sources, 10, 4, LEVELS, floor=0.3)
    assert min(shallow.path_probs) >= 0.3 and len(shallow) < len(tree)


def test_empty_inputs_give_empty_trees():
    assert len(grow_tree([], 8, 4, LEVELS)[0]) == 0
    sources = random_sources(0)
    assert len(grow_tree(sources, 0, 4, LEVELS)[0]) == 0
    assert len(grow_tree(sources, 8, 0, LEVELS)[0]) == 0
    assert len(grow_tree(sources, 3, 2, LEVELS)[0]) == 3


def test_with_acceptance_chances_a_wide_tree_holds_the_paths_likeliest_to_be_accepted():
    """``chance`` (what verification showed of estimates like these, by depth) replaces the
    estimate in the path probabilities: here deep estimates are discounted, so the tree goes wider."""
    def chance(depth, estimate):
        return estimate * 0.5 ** depth

    for seed in range(5):
        sources = random_sources(seed)
        size = 12
        tree, _ = grow_tree(sources, size, width=size, levels=LEVELS, chance=chance)
        chosen = node_paths(tree)
        scored = {}
        frontier = [((), sources, 1.0)]
        while frontier:  # every path's product of chances, by brute force
            path, at, prob = frontier.pop()
            for p, token in continuation_estimates(at, LEVELS, 100, min_length=1):
                here = prob * chance(len(path), p)
                if here >= min(tree.path_probs) * (1 - 1e-9):
                    scored[path + (token,)] = (here, p)
                    frontier.append((path + (token,), step_sources(at, token), here))
        for path, prob, estimate in zip(chosen, tree.path_probs, tree.probs, strict=True):
            assert (prob, estimate) == pytest.approx(scored[path])  # the nodes keep their estimates
        left_out = set(scored) - set(chosen)
        assert all(scored[path][0] <= min(tree.path_probs) * (1 + 1e-9) for path in left_out)
        plain, _ = grow_tree(sources, size, width=size, levels=LEVELS)
        depth = [len(p) for p in node_paths(plain)]
        assert sum(len(p) for p in chosen) <= sum(depth)  # discounted depth: no deeper than without
