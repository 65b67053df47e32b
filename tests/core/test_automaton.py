import random

from ngramrl.core.automaton import ROOT, SuffixAutomaton


def occurrences(seqs, pattern):
    n = len(pattern)
    return sum(1 for s in seqs for end in range(n - 1, len(s)) if s[end - n + 1:end + 1] == pattern)


def test_against_brute_force_with_interleaved_sequences():
    rng = random.Random(0)
    for _ in range(150):
        seqs = [[rng.randint(0, 3) for _ in range(rng.randint(0, 25))] for _ in range(rng.randint(1, 4))]
        sam = SuffixAutomaton()
        cursors = [sam.new_sequence() for _ in seqs]
        done = [0] * len(seqs)
        while any(done[i] < len(s) for i, s in enumerate(seqs)):
            i = rng.choice([i for i, s in enumerate(seqs) if done[i] < len(s)])
            cursors[i] = sam.extend(cursors[i], seqs[i][done[i]])
            done[i] += 1
        context = [rng.randint(0, 3) for _ in range(10)]
        state, matched = sam.match(context)
        longest = max([n for n in range(1, 11) if occurrences(seqs, context[-n:])], default=0)
        assert matched == longest
        if matched:
            assert sam.count[state] == occurrences(seqs, context[-matched:])
            for token, child in sam.children(state).items():
                assert sam.count[child] == occurrences(seqs, context[-matched:] + [token])
        for s in range(1, sam.num_states):
            children = sam.children(s)
            if not children:
                assert sam.best_token[s] == -1
                continue
            assert sam.count[sam.best_state[s]] == max(sam.count[c] for c in children.values())
            assert children[sam.best_token[s]] == sam.best_state[s]
            assert sam.followed[s] == sum(sam.count[c] for c in children.values())


def test_newest_continuation_wins_ties():
    sam = SuffixAutomaton()
    sam.add_sequence([1, 2, 3])
    sam.add_sequence([1, 2, 4])
    state, _ = sam.match([1, 2])
    assert sam.best_token[state] == 4
    sam.add_sequence([1, 2, 3])
    assert sam.best_token[state] == 3


def test_unknown_token_resets_match():
    sam = SuffixAutomaton()
    sam.add_sequence([5, 6, 7])
    assert sam.match([5, 6, 9]) == (ROOT, 0)
    state, matched = sam.match([9, 6, 7])
    assert matched == 2 and sam.best_token[state] == -1
