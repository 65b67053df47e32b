import pytest

from ngramrl.core.cost import StepCostModel, choose_draft_lengths


def test_fit_recovers_a_linear_step_time():
    model = StepCostModel(decay=1.0)
    for tokens in (4, 8, 16, 32, 9, 40):
        model.observe(tokens, 0.005 + 0.0005 * tokens)
    base, per_token = model.coefficients
    assert base == pytest.approx(0.005, rel=1e-6) and per_token == pytest.approx(0.0005, rel=1e-6)


def test_free_verification_keeps_whole_drafts():
    model = StepCostModel(decay=1.0)
    for tokens in (4, 8, 16, 32):
        model.observe(tokens, 0.02)
    assert choose_draft_lengths([[0.9, 0.5, 0.1], [0.2]], model) == [3, 1]


def test_costly_verification_keeps_only_likely_tokens_and_shrinks_with_batch():
    model = StepCostModel(decay=1.0)
    for tokens in (1, 2, 4, 8, 16):
        model.observe(tokens, 0.001 + 0.001 * tokens)  # compute-bound: each token costs as much as the base
    survival = [0.95, 0.8, 0.4, 0.1]
    one = choose_draft_lengths([survival], model)[0]
    many = choose_draft_lengths([survival] * 32, model)
    assert 0 < one < 4
    assert max(many) <= one
    assert choose_draft_lengths([[0.05, 0.01]], model) == [0]


def test_decision_raises_expected_throughput():
    model = StepCostModel(decay=1.0)
    for tokens in (2, 6, 10, 20):
        model.observe(tokens, 0.004 + 0.0008 * tokens)
    survival = [[0.9, 0.7, 0.3, 0.2], [0.6, 0.2], [0.1]]
    chosen = choose_draft_lengths(survival, model)

    def throughput(lengths):
        committed = sum(1 + sum(s[:n]) for s, n in zip(survival, lengths, strict=True))
        return committed / model.step_time(sum(1 + n for n in lengths))

    best = throughput(chosen)
    for r in range(3):
        for delta in (-1, 1):
            other = list(chosen)
            other[r] += delta
            if 0 <= other[r] <= len(survival[r]):
                assert throughput(other) <= best + 1e-12
