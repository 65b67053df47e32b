"""The proposer's counters (``NgramRLProposer.stats_dict``) turned into per-window rates."""

from __future__ import annotations

from typing import Any

COUNTERS = ("steps", "row_steps", "committed_tokens", "drafts", "drafted_tokens", "lookup_rows", "prefetch_hits",
            "cut_tokens", "pool_calls", "pool_synced_prompts", "pool_late_syncs", "pool_down_prompts", "pool_errors",
            "pool_reconnects", "draft_us_total", "followed_drafts", "followed_accepted")


def counters(stats: dict[str, Any] | None) -> dict[str, float]:
    stats = stats or {}
    return {name: float(stats.get(name) or 0.0) for name in COUNTERS}


def delta(now: dict[str, float], last: dict[str, float]) -> dict[str, float]:
    return {name: now[name] - last.get(name, 0.0) for name in COUNTERS}


def ratio(numerator: float, denominator: float, empty: float = 0.0) -> float:
    return numerator / denominator if denominator else empty


def draft_rates(window: dict[str, float]) -> dict[str, float]:
    """Rates over a window of counters: every forward of a request commits its accepted draft
    tokens plus one, so accepted = committed - forwards."""
    forwards = window.get("row_steps", 0.0)
    committed = window.get("committed_tokens", 0.0)
    return {"tokens_per_forward": ratio(committed, forwards, 1.0),
            # What the history offers: tokens per forward if every draft were verified whole (the
            # step-cost model verifies less where verifying costs more than it saves).
            "offered_tokens_per_forward": 1.0 + ratio(window.get("followed_accepted", 0.0),
                                                      window.get("followed_drafts", 0.0)),
            "acceptance": ratio(committed - forwards, window.get("drafted_tokens", 0.0)),
            "prefetch_coverage": ratio(window.get("prefetch_hits", 0.0), window.get("lookup_rows", 0.0)),
            "drafter_ms_per_step": ratio(window.get("draft_us_total", 0.0), window.get("steps", 0.0)) / 1000,
            "pool_unsynced_prompts": window.get("pool_down_prompts", 0.0)}
