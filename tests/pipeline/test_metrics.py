"""Rates from the proposer's counters."""

import pytest

from ngramrl.pipeline.metrics import COUNTERS, RATES, counters, delta, draft_rates


def test_rates_over_a_window():
    last = counters({"row_steps": 10, "committed_tokens": 10, "steps": 5})
    now = counters({"row_steps": 30, "committed_tokens": 70, "drafts": 20, "drafted_tokens": 60, "prefetch_hits": 5,
                    "lookup_rows": 25, "steps": 15, "draft_us_total": 20_000, "pool_down_prompts": 3})
    rates = draft_rates(delta(now, last))
    assert rates["tokens_per_forward"] == pytest.approx(60 / 20)      # 60 tokens in 20 forwards
    assert rates["acceptance"] == pytest.approx((60 - 20) / 60)       # 40 of 60 drafted tokens accepted
    assert rates["prefetch_coverage"] == pytest.approx(5 / 25)  # of 25 lookups, 5 were ready
    assert rates["drafter_ms_per_step"] == pytest.approx(2.0)
    assert rates["pool_unsynced_prompts"] == 3


def test_a_rate_of_an_empty_window_is_no_measurement():
    """A window that counted nothing to divide by measures nothing: None, not 0 (all rejected,
    nothing covered) or 1 (no gain)."""
    rates = draft_rates(delta(counters(None), counters(None)))
    assert rates == {"tokens_per_forward": None, "offered_tokens_per_forward": None, "acceptance": None,
                     "prefetch_coverage": None, "drafter_ms_per_step": None, "pool_unsynced_prompts": 0.0}
    assert tuple(rates) == RATES
    assert set(counters({"unrelated": 3})) == set(COUNTERS)
    steps_without_drafts = draft_rates(counters({"row_steps": 10, "committed_tokens": 10, "steps": 10}))
    assert steps_without_drafts["tokens_per_forward"] == 1.0 and steps_without_drafts["acceptance"] is None


def test_offered_tokens_per_forward_is_the_windows_tokens_over_the_forwards_whole_drafts_would_take():
    """Followed drafts (empty ones too) give the tokens a decode forward commits with whole
    drafts, 1 + 15 / 10; the 4 first forwards (the prefills') commit one token each whatever the
    drafts: the window's 42 tokens would take 4 + 38 / 2.5 forwards."""
    window = delta(counters({"followed_drafts": 10, "followed_accepted": 15, "row_steps": 40, "committed_tokens": 42,
                             "first_rows": 4}), counters(None))
    rates = draft_rates(window)
    assert rates["offered_tokens_per_forward"] == pytest.approx(42 / (4 + 38 / 2.5))
    assert rates["tokens_per_forward"] == 42 / 40
    nothing_accepted = draft_rates({**window, "followed_accepted": 0.0})
    assert nothing_accepted["offered_tokens_per_forward"] == 1.0


@pytest.mark.parametrize("trace_name, epoch", [("products-smollm2-rl24", 0), ("products-smollm2-rl24", 1),
                                               ("gsm-smollm2-t0.6", 1)])
def test_with_every_draft_verified_whole_the_offered_tokens_per_forward_are_the_real_ones(trace_name, epoch):
    """With the step-cost model off every draft is verified whole, so what the followed drafts
    say whole drafts would give must be what the forwards gave (a simulated engine replaying a
    shipped trace's epoch, 16 requests in flight, through the real proposer)."""
    from ngramrl.bench.bench_steps import default_profile, replay_history
    from ngramrl.bench.run import builtin_traces, load_traces
    from ngramrl.bench.steps import build_engine, prepare_workload
    from ngramrl.config import EngineConfig, NgramRLConfig

    trace = load_traces([next(p for p in builtin_traces() if trace_name in p)])[0]
    workload = prepare_workload(trace, epoch, 1, epoch)
    config = NgramRLConfig(history=replay_history(trace, False), engine=EngineConfig(adaptive_length=False))
    engine = build_engine("ngramrl", workload, 8, default_profile(8), 1, 0, config=config, wait_out=False)
    records = engine.run_phase(workload.phases[0], 16)
    stats = engine.proposer.stats_dict()
    engine.close()
    forwards, committed = sum(r.rows for r in records), sum(r.committed for r in records)
    assert stats["row_steps"] == forwards and stats["committed_tokens"] == committed
    rates = draft_rates(counters(stats))
    assert rates["tokens_per_forward"] == pytest.approx(committed / forwards)
    assert rates["offered_tokens_per_forward"] == pytest.approx(committed / forwards, rel=0.03)
    # (the simulated engine ends a rollout where the trace does, which its requests do not say: a
    # few drafts at those ends are sent and not verified)
    assert rates["acceptance"] == pytest.approx((committed - forwards) / sum(r.draft_tokens for r in records), rel=0.02)
