"""The proposer's counters (``NgramRLProposer.stats_dict``) turned into per-window rates."""

from __future__ import annotations

from typing import Any

COUNTERS = ("steps", "row_steps", "first_rows", "committed_tokens", "drafts", "drafted_tokens", "lookup_rows",
            "prefetch_hits", "cut_tokens", "pool_calls", "pool_synced_prompts", "pool_late_syncs", "pool_down_prompts",
            "pool_errors", "pool_reconnects", "draft_us_total", "followed_drafts", "followed_accepted")


def counters(stats: dict[str, Any] | None) -> dict[str, float]:
    stats = stats or {}
    return {name: float(stats.get(name) or 0.0) for name in COUNTERS}


def delta(now: dict[str, float], last: dict[str, float]) -> dict[str, float]:
    return {name: now[name] - last.get(name, 0.0) for name in COUNTERS}


def ratio(numerator: float, denominator: float) -> float | None:
    """None where nothing was counted: a rate of an empty window is no measurement, and 0 or 1
    would read as one (nothing accepted, nothing covered, no gain)."""
    return numerator / denominator if denominator else None


def draft_rates(window: dict[str, float]) -> dict[str, float | None]:
    """Rates over a window of counters: every forward of a request commits its accepted draft
    tokens plus one, so accepted = committed - forwards. A rate whose window counted nothing to
    divide by is None."""
    forwards = window.get("row_steps", 0.0)
    committed = window.get("committed_tokens", 0.0)
    drafter_us = ratio(window.get("draft_us_total", 0.0), window.get("steps", 0.0))
    return {"tokens_per_forward": ratio(committed, forwards),
            "offered_tokens_per_forward": offered_tokens_per_forward(window),
            "acceptance": ratio(committed - forwards, window.get("drafted_tokens", 0.0)),
            "prefetch_coverage": ratio(window.get("prefetch_hits", 0.0), window.get("lookup_rows", 0.0)),
            "drafter_ms_per_step": None if drafter_us is None else drafter_us / 1000,
            "pool_unsynced_prompts": window.get("pool_down_prompts", 0.0)}


def offered_tokens_per_forward(window: dict[str, float]) -> float | None:
    """What the history offers: the window's tokens per forward had every draft been verified
    whole (the step-cost model verifies less where verifying costs more than it saves). The
    followed drafts (an empty one counts, with nothing accepted) give the tokens a decode forward
    would commit, 1 + accepted / drafts; a request's first forward (the prefill's) commits one
    token whatever the drafts, so the window's tokens take ``first_rows`` + (the rest / that)
    forwards."""
    followed = window.get("followed_drafts", 0.0)
    committed = window.get("committed_tokens", 0.0)
    if not followed or not committed:
        return None
    per_decode_forward = 1.0 + window.get("followed_accepted", 0.0) / followed
    first = min(window.get("first_rows", 0.0), committed)
    return committed / (first + (committed - first) / per_decode_forward)


RATES = tuple(draft_rates({}))  # the rates' names, in draft_rates' order
