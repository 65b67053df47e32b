import pytest

from ngramrl.core.cost import StepCostModel, choose_draft_lengths


def fitted(points):
    model = StepCostModel(decay=1.0)
    for requests, drafts, seconds in points:
        model.observe(requests, drafts, seconds)
    return model


def test_fit_recovers_base_per_request_and_per_token_costs():
    truth = (0.004, 0.003, 0.0005)
    points = [(r, d, truth[0] + truth[1] * r + truth[2] * d) for r in (1, 8, 32) for d in (0, 5, 40, 100)]
    assert fitted(points).coefficients == pytest.approx(truth, rel=1e-3, abs=1e-6)


def test_free_verification_keeps_whole_drafts():
    model = fitted([(r, d, 0.02 + 0.001 * r) for r in (1, 8) for d in (0, 8, 32)])
    assert choose_draft_lengths([[0.9, 0.5, 0.1], [0.2]], model) == [3, 1]


def test_costly_verification_keeps_only_likely_tokens_and_shrinks_with_batch():
    # Compute-bound: each verified draft token costs as much as a request's own token.
    model = fitted([(r, d, 0.001 + 0.001 * (r + d)) for r in (1, 4, 16) for d in (0, 4, 16)])
    survival = [0.95, 0.8, 0.4, 0.1]
    one = choose_draft_lengths([survival], model)[0]
    many = choose_draft_lengths([survival] * 32, model)
    assert 0 < one < 4
    assert max(many) <= one
    assert choose_draft_lengths([[0.05, 0.01]], model) == [0]


def test_decision_raises_expected_throughput():
    model = fitted([(r, d, 0.004 + 0.002 * r + 0.0008 * d) for r in (1, 3, 9) for d in (0, 6, 20)])
    survival = [[0.9, 0.7, 0.3, 0.2], [0.6, 0.2], [0.1]]
    chosen = choose_draft_lengths(survival, model)

    def throughput(lengths):
        committed = sum(1 + sum(s[:n]) for s, n in zip(survival, lengths, strict=True))
        return committed / model.step_time(len(survival), sum(lengths))

    best = throughput(chosen)
    for r in range(3):
        for delta in (-1, 1):
            other = list(chosen)
            other[r] += delta
            if 0 <= other[r] <= len(survival[r]):
                assert throughput(other) <= best + 1e-12


def test_rejects_bad_decay():
    with pytest.raises(ValueError):
        StepCostModel(decay=0.0)
