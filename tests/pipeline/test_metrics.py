"""Rates from the proposer's counters."""

import pytest

from ngramrl.pipeline.metrics import COUNTERS, counters, delta, draft_rates


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


def test_an_empty_window_means_no_drafting():
    rates = draft_rates(delta(counters(None), counters(None)))
    assert rates == {"tokens_per_forward": 1.0, "offered_tokens_per_forward": 1.0, "acceptance": 0.0,
                     "prefetch_coverage": 0.0, "drafter_ms_per_step": 0.0, "pool_unsynced_prompts": 0.0}
    assert set(counters({"unrelated": 3})) == set(COUNTERS)


def test_offered_tokens_per_forward_comes_from_the_followed_drafts():
    window = delta(counters({"followed_drafts": 10, "followed_accepted": 15, "row_steps": 40, "committed_tokens": 42}),
                   counters(None))
    rates = draft_rates(window)
    assert rates["offered_tokens_per_forward"] == 2.5 and rates["tokens_per_forward"] == 42 / 40
