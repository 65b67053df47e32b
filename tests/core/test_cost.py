import numpy as np
import pytest

from ngramrl.core.cost import (
    FixedStepCost,
    StepCostModel,
    choose_draft_lengths,
    drafting_pays,
    fit_plateau,
    probe_lengths,
)


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


def gpu_like(requests, drafts, knee=256):
    """A memory-bound plateau: reading the weights costs the same up to ``knee`` tokens a step."""
    return 0.006 + 0.00001 * requests + 0.00002 * max(0, requests + drafts - knee)


def test_fit_finds_a_memory_bound_plateau_and_predicts_across_it():
    points = [(r, d, gpu_like(r, d)) for r in (8, 32, 64, 128) for d in (0, r, 2 * r, 4 * r, 8 * r)]
    model = fitted(points)
    assert 192 <= model.knee <= 384
    assert model.coefficients[2] == pytest.approx(0.00002, rel=0.3)
    for r, d, seconds in points:
        assert model.step_time(r, d) == pytest.approx(seconds, rel=0.05)
    linear = StepCostModel(decay=1.0)
    linear._knees[:] = 0  # noqa: SLF001 - the same fit without a plateau, for contrast
    for r, d, seconds in points:
        linear.observe(r, d, seconds)
    worst = max(abs(linear.step_time(r, d) - t) / t for r, d, t in points)
    assert worst > 0.15  # a straight line cannot follow the plateau


def test_tokens_inside_the_plateau_are_kept_even_when_unlikely():
    model = FixedStepCost(0.006, 0.00001, 0.00002, 0.0, knee=256)
    weak = [[0.3, 0.2, 0.1, 0.05]] * 32  # 128 draft tokens: all inside the plateau at 32 requests
    assert choose_draft_lengths(weak, model) == [4] * 32
    assert model.drafting_can_pay(32)
    crowded = [[0.3, 0.2, 0.1, 0.05]] * 250  # the plateau holds 6 draft tokens at 250 requests
    assert sum(choose_draft_lengths(crowded, model)) == 6


@pytest.mark.parametrize("seed", range(5))
def test_a_cpus_linear_steps_keep_the_linear_fit(seed):
    # Every token costs, as on a CPU (the engine's fit at 8 requests in flight), with 3% noise.
    import random

    rng = random.Random(seed)
    truth = (9.2e-05, 0.00294, 0.00225, 3.4e-05)
    points = [(r, d, (truth[0] + truth[1] * r + truth[2] * d + truth[3] * (d > 0)) * rng.uniform(0.97, 1.03))
              for r in (4, 8, 16) for d in (0, 0, 1, 4, 8) for _ in range(4)]
    model = fitted(points)
    assert model.knee == 0
    assert model.coefficients[2] == pytest.approx(truth[2], rel=0.15)


def test_plateau_fit_of_one_batch_size():
    points = [(d, 0.01 + 0.00003 * max(0, d - 100)) for d in (0, 32, 64, 128, 256, 512)]
    base, per_token, free = fit_plateau(points)
    assert base == pytest.approx(0.01, rel=0.01) and per_token == pytest.approx(0.00003, rel=0.1)
    assert 64 <= free <= 128
    assert fit_plateau([(d, 0.01) for d in (0, 8, 64)])[1:] == (0.0, 64.0)  # flat: all free


def test_lookups_must_pay_for_the_proposers_own_time():
    model = FixedStepCost(0.006, 0.00001, 0.0, 0.0)  # verifying is free
    # 32 requests in a 6.3 ms step, drafts expected to add 8 tokens (25%): worth 0.8 ms of lookups, not 3 ms
    assert drafting_pays(model, 32, 64, 8.0, drafting_s=0.0008, plain_s=0.0002, min_gain=0.1)
    assert not drafting_pays(model, 32, 64, 8.0, drafting_s=0.003, plain_s=0.0002, min_gain=0.1)


def test_the_fit_with_its_plateau_is_carried_to_a_new_model():
    model = fitted([(r, d, gpu_like(r, d)) for r in (16, 64) for d in (0, r, 4 * r, 8 * r)])
    again = StepCostModel()
    again.load_state(model.state())
    assert again.knee == model.knee and again.coefficients == pytest.approx(model.coefficients)


def test_nearly_free_verification_keeps_even_a_weak_draft():
    # A GPU at batch 1: a draft token adds 1.8 us to a 5.5 ms step. A draft expected to bring 0.07
    # tokens still pays; the margin applies to the estimates, not as a demand for a 10% faster step.
    model = FixedStepCost(0.0055, 0.00001, 0.0000018, 0.0)
    assert choose_draft_lengths([[0.05, 0.02]], model, min_gain=0.1) == [2]
    # a CPU at 32 requests: one likely token (0.6) is not worth 2% more step time with the margins
    cpu = FixedStepCost(0.026, 0.00236, 0.00186, 0.00006)
    assert choose_draft_lengths([[0.6]] + [[]] * 31, cpu, min_gain=0.1) == [0] * 32


def test_a_fit_solved_every_few_steps_folds_every_step_in_with_its_decay():
    points = [(r, d, 0.01 + 0.001 * r + 0.0004 * d * (1 + r % 3)) for r in (1, 4, 9) for d in (0, 3, 8, 20)]
    every = StepCostModel(decay=0.9)
    sparse = StepCostModel(decay=0.9, refit_every=4)
    for point in points[:8]:
        every.observe(*point)
        sparse.observe(*point)
    held = sparse.coefficients
    for point in points[8:11]:  # three steps: the fit is not solved again yet
        every.observe(*point)
        sparse.observe(*point)
        assert sparse.coefficients == held
    every.observe(*points[11])
    sparse.observe(*points[11])
    assert sparse.coefficients != held
    assert sparse.coefficients == pytest.approx(every.coefficients, rel=1e-9, abs=1e-12)
    assert np.allclose(sparse.state()["xtx"], every.state()["xtx"], rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="refit_every"):
        StepCostModel(refit_every=0)


def _observed_stream(model, seed, steps=300):
    """Steps of a GPU-like engine (a plateau of 256 tokens) at changing batch sizes, the fit read
    now and then, as the proposer reads it."""
    rng = np.random.default_rng(seed)
    fits = []
    for i in range(steps):
        requests = int(rng.integers(1, 300))
        drafts = int(rng.integers(0, 9 * requests)) if rng.random() < 0.8 else 0
        seconds = (0.004 + 2e-5 * requests + 3e-6 * max(0, requests + drafts - 256) + (2e-4 if drafts else 0)
                   + rng.normal(0, 2e-5))
        model.observe(requests, drafts, seconds)
        if i % 7 == 0:
            fits.append(model.fit)
    return fits


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_native_fit_gives_the_numpy_fit(seed, monkeypatch):
    from ngramrl.core.extension import native_module

    if native_module() is None:
        pytest.skip("the native core is not built (pip install . builds it)")
    native = StepCostModel(decay=0.98, refit_every=4)
    native_fits = _observed_stream(native, seed)
    monkeypatch.setenv("NGRAMRL_NATIVE", "0")
    reference = StepCostModel(decay=0.98, refit_every=4)
    reference_fits = _observed_stream(reference, seed)
    assert [fit[-1] for fit in native_fits] == [fit[-1] for fit in reference_fits]  # the same knees
    assert native_fits[-1][-1] == 256
    for ours, theirs in zip(native_fits, reference_fits, strict=True):
        assert ours[:-1] == pytest.approx(theirs[:-1], rel=1e-9, abs=1e-15)
    assert np.allclose(native.state()["xtx"], reference.state()["xtx"], rtol=1e-12, atol=0)
    # carried to a new model, the native one goes on from the reference's sums
    monkeypatch.delenv("NGRAMRL_NATIVE")
    carried = StepCostModel(decay=0.98, refit_every=4)
    carried.load_state(reference.state())
    carried.observe(40, 100, 0.0049)
    carried_fit = carried.fit  # observations fold in when the fit is read: read it with the native core on
    monkeypatch.setenv("NGRAMRL_NATIVE", "0")
    reference.observe(40, 100, 0.0049)
    assert carried_fit == pytest.approx(reference.fit, rel=1e-9, abs=1e-15)


def test_the_native_fold_refuses_sums_it_would_have_to_copy():
    from ngramrl.core.extension import native_module

    native = native_module()
    if native is None:
        pytest.skip("the native core is not built (pip install . builds it)")
    xtx, xty = np.zeros((3, 4, 4), dtype=np.float32), np.zeros((3, 4))
    with pytest.raises(TypeError):  # a float32 copy would take the update, not the model's sums
        native.step_cost_fold(xtx, xty, 0.0, np.zeros((1, 3)), np.zeros(3), 0.9)
    with pytest.raises(ValueError, match="one knee per row"):
        native.step_cost_fold(np.zeros((3, 4, 4)), xty, 0.0, np.zeros((1, 3)), np.zeros(2), 0.9)
