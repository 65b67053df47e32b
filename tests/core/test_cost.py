import pytest

from ngramrl.core.cost import StepCostModel, choose_draft_lengths, probe_lengths


def fitted(points):
    model = StepCostModel(decay=1.0)
    for requests, drafts, seconds in points:
        model.observe(requests, drafts, seconds)
    return model


def test_fit_recovers_base_per_request_per_token_and_per_verify_costs():
    truth = (0.004, 0.003, 0.0005, 0.002)
    points = [(r, d, truth[0] + truth[1] * r + truth[2] * d + truth[3] * (d > 0))
              for r in (1, 8, 32) for d in (0, 5, 40, 100)]
    assert fitted(points).coefficients == pytest.approx(truth, rel=1e-3, abs=1e-6)


def test_fit_is_cached_and_refreshed_by_new_steps():
    model = fitted([(r, d, 0.01 + 0.001 * d) for r in (1, 2) for d in (0, 4, 8)])
    first = model.coefficients
    assert model.coefficients is first
    for d in (0, 4, 8):
        model.observe(1, d, 0.01 + 0.002 * d)
    assert model.coefficients[2] > first[2]


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
    assert best >= throughput([0] * len(survival))
    for r in range(3):
        for delta in (-1, 1):
            other = list(chosen)
            other[r] += delta
            if 0 <= other[r] <= len(survival[r]):
                assert throughput(other) <= best + 1e-12


def test_fixed_verification_cost_turns_weak_drafts_off_but_keeps_strong_ones():
    # A verifying step pays 5 ms once; tokens are cheap. One weak draft token cannot pay for it.
    model = fitted([(r, d, 0.02 + 0.001 * r + 0.0002 * d + 0.005 * (d > 0)) for r in (1, 4, 8) for d in (0, 1, 4, 16)])
    assert choose_draft_lengths([[0.1], [0.1]], model) == [0, 0]
    assert choose_draft_lengths([[0.99, 0.98, 0.97, 0.96]] * 8, model) == [4] * 8


def test_nothing_pays_at_large_compute_bound_batches():
    # Each verified token costs as much as a request's own token (a CPU at batch 32): nothing pays.
    model = fitted([(r, d, 0.003 * r + 0.0031 * d + 0.001 * (d > 0)) for r in (16, 24, 32) for d in (0, 1, 4)])
    assert not model.drafting_can_pay(32)
    assert choose_draft_lengths([[0.9, 0.8]] * 32, model) == [0] * 32
    assert StepCostModel().drafting_can_pay(32)  # nothing measured yet: drafting is not ruled out


def test_probe_takes_the_likeliest_tokens_of_the_batch():
    survival = [[0.9, 0.5], [0.95, 0.2], [], [0.3]]
    assert probe_lengths(survival, 1) == [0, 1, 0, 0]
    assert probe_lengths(survival, 3) == [2, 1, 0, 0]
    assert probe_lengths(survival, 10) == [2, 2, 0, 1]


def test_rejects_bad_decay():
    with pytest.raises(ValueError):
        StepCostModel(decay=0.0)


def test_survival_chances_are_computed_only_as_far_as_read():
    from ngramrl.core.outcome import AcceptanceCalibration, Survival

    calibration = AcceptanceCalibration()
    calibration.observe([0.9, 0.9], accepted=1)
    probs = [0.9, 0.8, 0.5, 0.4]
    eager, running = [], 1.0
    for position, p in enumerate(probs):
        running *= calibration.chance(position, p)
        eager.append(running)
    lazy = Survival(probs, calibration, scale=0.5)
    assert len(lazy) == 4 and lazy[0] == pytest.approx(0.5 * eager[0])
    assert len(lazy._values) == 1  # noqa: SLF001 - nothing past what was read
    assert lazy[:3] == pytest.approx([0.5 * v for v in eager[:3]])
    model = fitted([(r, d, 0.001 + 0.003 * r + 0.0031 * d) for r in (16, 32) for d in (0, 1, 4)])
    choose_draft_lengths([Survival(probs, calibration) for _ in range(32)], model)  # lazy rows are accepted
