"""A step's rows as arrays: the drafts of a step (``DraftBatch``), the outcomes a prefetch chose
(``OutcomeBatch``), and what a vLLM step hands the proposer, as the drafting core takes it
(``committed_rows``, ``batch_ranks``). After a forward has flushed the caches each NumPy call
costs 10-30 us at a few hundred rows, so each helper is one C++ pass where the native core is
built (``ngramrl/native/rows.hpp``), with its NumPy reference here."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ngramrl.core.drafter import Draft
from ngramrl.core.extension import native_module

SOURCES = ("none", "prompt", "global")  # DraftBatch.source codes


@dataclass
class DraftBatch:
    """One draft per row, flat: row i is ``tokens[offsets[i]:offsets[i + 1]]``."""

    tokens: np.ndarray      # int32
    offsets: np.ndarray     # int64, rows + 1
    probs: np.ndarray       # float64, per token: the drafter's estimate that it follows
    matched: np.ndarray     # int32, per row: the context length the draft was matched on
    source: np.ndarray      # int8, per row: index into SOURCES
    prefetched: np.ndarray  # bool, per row: the draft came from the prefetch

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def draft(self, row: int) -> Draft:
        begin, end = int(self.offsets[row]), int(self.offsets[row + 1])
        return Draft(self.tokens[begin:end].tolist(), self.probs[begin:end].tolist(), int(self.matched[row]),
                     SOURCES[int(self.source[row])])

    def drafts(self) -> list[Draft]:
        """Every row's draft (one conversion of each array, not one per row)."""
        tokens, probs, offsets = self.tokens.tolist(), self.probs.tolist(), self.offsets.tolist()
        return [Draft(tokens[offsets[i]:offsets[i + 1]], probs[offsets[i]:offsets[i + 1]], matched, SOURCES[source])
                for i, (matched, source) in enumerate(zip(self.matched.tolist(), self.source.tolist(), strict=True))]

    def lists(self, size: int, positions: Any, rows: Any) -> list[list[int]]:
        """``size`` lists of token ids (vLLM's drafts): list ``positions[i]`` holds row ``rows[i]``'s
        draft, every other list is empty, and each is its own object (vLLM trims them in place).
        Built in C++ where the native core is built (a list of lists is one Python object per
        row and per token, most of a big batch's time outside the core in Python)."""
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        native = native_module()
        if native is not None:
            return native.draft_lists(int(size), positions, rows, np.ascontiguousarray(self.tokens, dtype=np.int32),
                                      np.ascontiguousarray(self.offsets, dtype=np.int64))
        if len(positions) != len(rows):
            raise ValueError(f"draft_lists: {len(positions)} positions but {len(rows)} rows")
        if len(positions) and (positions.min() < 0 or positions.max() >= size):
            raise ValueError(f"draft_lists: a position outside 0..{size - 1}")
        if len(rows) and (rows.min() < 0 or rows.max() >= len(self)):
            raise ValueError(f"draft_lists: a row outside 0..{len(self) - 1}")
        out: list[list[int]] = [[] for _ in range(size)]
        tokens = self.tokens.tolist()
        begins, ends = self.offsets[rows].tolist(), self.offsets[rows + 1].tolist()
        for position, begin, end in zip(positions.tolist(), begins, ends, strict=True):
            out[position] = tokens[begin:end]
        return out

    def truncated(self, lengths: Any, vocab_size: int | None = None) -> DraftBatch:
        """Each row's first ``lengths[i]`` tokens (at most all of them), and with ``vocab_size`` no
        further than its first token outside the vocabulary (0..vocab_size - 1): what may go to the
        target, whose kernels index the vocabulary with the draft's tokens. One C++ pass where the
        native core is built."""
        keep = np.ascontiguousarray(lengths, dtype=np.int64).reshape(-1)
        if len(keep) != len(self):
            raise ValueError(f"truncated: {len(keep)} lengths for {len(self)} rows")
        native = native_module()
        if native is not None:
            tokens, offsets, probs = native.truncate_rows(
                np.ascontiguousarray(self.tokens, dtype=np.int32), np.ascontiguousarray(self.offsets, dtype=np.int64),
                np.ascontiguousarray(self.probs, dtype=np.float64), keep, -1 if vocab_size is None else int(vocab_size))
            return DraftBatch(tokens, offsets, probs, self.matched, self.source, self.prefetched)
        sizes = np.diff(self.offsets)
        keep = np.clip(keep, 0, sizes)
        if vocab_size is not None:
            bad = np.flatnonzero((self.tokens < 0) | (self.tokens >= vocab_size))
            if len(bad):
                row = np.searchsorted(self.offsets, bad, side="right") - 1
                np.minimum.at(keep, row, bad - self.offsets[row])
        position = np.arange(len(self.tokens)) - np.repeat(self.offsets[:-1], sizes)
        mask = position < np.repeat(keep, sizes)
        offsets = np.zeros(len(keep) + 1, dtype=np.int64)
        np.cumsum(keep, out=offsets[1:])
        return DraftBatch(self.tokens[mask], offsets, self.probs[mask], self.matched, self.source, self.prefetched)

    def for_target(self, lengths: Any, vocab_size: int | None, size: int, positions: Any,
                   recycled: Any = None) -> tuple[DraftBatch, list[list[int]], int]:
        """What goes to the target: ``truncated(lengths, vocab_size)``, its rows as vLLM's ``size``
        lists (row i in list ``positions[i]``, the others empty; ``lists``), and the tokens within
        ``lengths`` before the vocabulary cut. One C++ pass where the native core is built;
        ``recycled`` (``recycled_lists()``) makes the lists out of those handed out before that
        only it still holds."""
        native = native_module()
        if native is not None:  # it checks and converts the arrays itself (each NumPy call costs after a forward)
            tokens, offsets, probs, lists, kept = native.target_rows(
                self.tokens, self.offsets, self.probs, lengths, -1 if vocab_size is None else int(vocab_size),
                int(size), positions, recycled)
            return DraftBatch(tokens, offsets, probs, self.matched, self.source, self.prefetched), lists, kept
        keep = np.ascontiguousarray(lengths, dtype=np.int64).reshape(-1)
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        if len(keep) != len(self) or len(positions) != len(self):
            raise ValueError(f"for_target: {len(keep)} lengths and {len(positions)} positions for {len(self)} rows")
        sent = self.truncated(keep, vocab_size)
        kept = int(np.minimum(np.maximum(keep, 0), np.diff(self.offsets)).sum())
        return sent, sent.lists(size, positions, np.arange(len(self))), kept

    @classmethod
    def from_drafts(cls, drafts: list[Draft], prefetched: list[bool] | None = None) -> DraftBatch:
        lengths = np.fromiter((len(d.tokens) for d in drafts), dtype=np.int64, count=len(drafts))
        offsets = np.zeros(len(drafts) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return cls(np.fromiter((t for d in drafts for t in d.tokens), dtype=np.int32, count=int(offsets[-1])),
                   offsets,
                   np.fromiter((p for d in drafts for p in d.probs), dtype=np.float64, count=int(offsets[-1])),
                   np.array([d.matched for d in drafts], dtype=np.int32),
                   np.array([SOURCES.index(d.source) for d in drafts], dtype=np.int8),
                   np.array(prefetched or [False] * len(drafts), dtype=bool))


def recycled_lists() -> Any:
    """What ``DraftBatch.for_target`` makes vLLM's lists of, step after step (the native core's
    ``DraftLists``: each list handed out is held, and refilled once nobody else holds it, instead
    of a new one allocated); None without the native core."""
    native = native_module()
    return native.DraftLists() if native is not None else None


@dataclass
class OutcomeBatch:
    """The outcomes a prefetch chose, likeliest first within a row, and the next draft of each."""

    rows: np.ndarray         # int32: the row of the prefetch call
    accepted: np.ndarray     # int32: j
    token: np.ndarray        # int32: b
    probability: np.ndarray  # float64
    drafts: DraftBatch       # one per outcome

    def __len__(self) -> int:
        return len(self.rows)

    @classmethod
    def empty(cls) -> OutcomeBatch:
        none = np.zeros(0, dtype=np.int32)
        return cls(none, none, none, np.zeros(0), DraftBatch.from_drafts([]))


@dataclass
class CommittedRows:
    """The rows of an engine step that commit tokens for a request with a prompt, in the order the
    requests came (``committed_rows``)."""

    index: np.ndarray   # int64: each row's place in the engine's batch
    ranks: np.ndarray   # int64: its arrival rank (rising)
    tokens: np.ndarray  # int32: the committed tokens, row i's at offsets[i]:offsets[i + 1]
    offsets: np.ndarray  # int64, rows + 1
    ks: np.ndarray      # int32: room for a draft of k tokens, less where the model's length ends first
    accepted: int       # draft tokens the target accepted of what these rows were sent last step
    with_room: int      # rows with ks > 0
    whole: bool         # every row of the batch, in the batch's order (index is 0, 1, 2, ...)
    num_tokens: np.ndarray  # int64: each row's tokens in the engine with this step's
    gaps: int = 0       # rows that held more tokens before this step's than when they were last seen
    gap_tokens: int = 0  # the tokens put before those rows' sampled ones (from ``token_ids``)


def committed_rows(sampled: list[list[int]], arrival: np.ndarray, num_tokens: Any, max_model_len: int, k: int,
                   sent_ranks: np.ndarray, sent_offsets: np.ndarray, sent_num_tokens: np.ndarray | None = None,
                   token_ids: Any = None, ends: np.ndarray | None = None) -> CommittedRows:
    """A vLLM step's rows as arrays: the rows i with an arrival rank (``arrival[i] >= 0``) and
    sampled tokens (``sampled[i]``, vLLM's token list per row), in arrival order; each row's room
    for a draft, ``min(k, end - num_tokens[i] - 1)`` (``num_tokens``: vLLM's tokens per row before
    this step's drafts; ``end``: ``max_model_len``, or ``ends[i]`` below it, the tokens the row's
    request may reach: a draft past its max_tokens is verified for nothing, and vLLM drops what it
    commits there); and the tokens accepted of the drafts sent last step to the
    rows ranked ``sent_ranks`` (rising), row r's ``sent_offsets[r + 1] - sent_offsets[r]`` tokens
    long: a row sent a draft committed its accepted tokens and one token of the target's. One C++
    pass where the native core is built.

    Gaps: with ``sent_num_tokens`` (each sent row's ``num_tokens`` then), a row that now holds more
    tokens before this step's than it did is one whose tokens of some step the proposer never saw
    (vLLM skips the drafter on a step where any request is within k tokens of ``max_model_len``).
    With ``token_ids`` (vLLM's ``token_ids_cpu``: row i's tokens), the tokens it missed are put
    before its sampled ones, so the request's sequence stays whole; ``gaps`` counts those rows."""
    arrival = np.ascontiguousarray(arrival, dtype=np.int64)
    sent_ranks = np.ascontiguousarray(sent_ranks, dtype=np.int64)
    sent_offsets = np.ascontiguousarray(sent_offsets, dtype=np.int64)
    sent_num_tokens = np.ascontiguousarray(sent_num_tokens if sent_num_tokens is not None else NO_COUNTS,
                                           dtype=np.int64)
    ends = np.ascontiguousarray(ends if ends is not None else NO_COUNTS, dtype=np.int64)
    native = native_module() if isinstance(sampled, list) else None
    if native is not None:
        try:
            *fields, gaps = native.committed_rows(sampled, arrival, num_tokens, int(max_model_len), int(k),
                                                  sent_ranks, sent_offsets, sent_num_tokens, ends)
            return _fill_gaps(CommittedRows(*fields), gaps, token_ids)
        except TypeError:  # rows that are not lists (tuples, arrays): the general path below
            pass
    n = len(arrival)
    if len(sampled) != n:
        raise ValueError(f"committed_rows: {len(sampled)} rows of sampled tokens for {n} arrival ranks")
    if len(num_tokens) < n:
        raise ValueError(f"committed_rows: {len(num_tokens)} token counts for {n} rows")
    if len(sent_offsets) != len(sent_ranks) + 1:
        raise ValueError(f"committed_rows: {len(sent_offsets)} sent offsets for {len(sent_ranks)} sent ranks "
                         "(one more is needed)")
    sent_lengths = np.diff(sent_offsets)
    if np.any(sent_ranks[1:] <= sent_ranks[:-1]):
        raise ValueError("committed_rows: the sent ranks must rise")
    if len(sent_num_tokens) not in (0, len(sent_ranks)):
        raise ValueError(f"committed_rows: {len(sent_num_tokens)} sent token counts for {len(sent_ranks)} sent ranks")
    if len(ends) not in (0, n):
        raise ValueError(f"committed_rows: {len(ends)} request ends for {n} rows")
    sizes = np.fromiter(map(len, sampled), np.int64, n)
    index = np.flatnonzero((arrival >= 0) & (sizes > 0))
    index = index[np.argsort(arrival[index], kind="stable")]
    ranks = arrival[index]
    offsets = np.zeros(len(index) + 1, dtype=np.int64)
    np.cumsum(sizes[index], out=offsets[1:])
    chosen = [sampled[i] for i in index.tolist()]
    tokens = np.fromiter(itertools.chain.from_iterable(chosen), np.int64, int(offsets[-1]))
    if len(tokens) and (tokens.min() < np.iinfo(np.int32).min or tokens.max() > np.iinfo(np.int32).max):
        raise ValueError("committed_rows: a token that is not an int32")
    held = np.asarray(num_tokens[:n], dtype=np.int64)[index]
    room = (np.minimum(ends[index], max_model_len) if len(ends) else max_model_len) - held - 1
    ks = np.clip(np.minimum(k, room), np.iinfo(np.int32).min, None).astype(np.int32)
    verified = np.zeros(len(index), dtype=np.int64)
    gaps: list[tuple[int, int, int]] = []
    if len(sent_ranks):
        at = np.minimum(np.searchsorted(sent_ranks, ranks), len(sent_ranks) - 1)
        seen = sent_ranks[at] == ranks
        verified = np.where(seen, sent_lengths[at], 0)
        if len(sent_num_tokens):
            before = held - np.diff(offsets)
            gaps = [(r, int(sent_num_tokens[at[r]]), int(before[r]))
                    for r in np.flatnonzero(seen & (before > sent_num_tokens[at])).tolist()]
    accepted = int((np.diff(offsets)[verified > 0] - 1).sum())
    whole = len(index) == n and bool(np.all(index == np.arange(n)))
    return _fill_gaps(CommittedRows(index, ranks, tokens.astype(np.int32), offsets, ks, accepted,
                                    int(np.count_nonzero(ks > 0)), whole, held), gaps, token_ids)


NO_COUNTS = np.zeros(0, dtype=np.int64)


def _fill_gaps(rows: CommittedRows, gaps: list[tuple[int, int, int]], token_ids: Any) -> CommittedRows:
    """``rows`` with each gap's missed tokens, ``token_ids[index[r], start:end]`` for a gap (r,
    start, end), put before row r's sampled tokens (``token_ids`` None: counted, not filled)."""
    if not gaps:
        return rows
    rows.gaps = len(gaps)
    if token_ids is None:
        return rows
    sizes = np.diff(rows.offsets)
    missed = np.zeros(len(sizes), dtype=np.int64)
    filled = []
    for r, start, end in gaps:
        tokens = np.asarray(token_ids[int(rows.index[r]), start:end], dtype=np.int32)
        if len(tokens) == end - start:  # a buffer shorter than its counts says: nothing to take
            missed[r] = end - start
            filled.append((r, tokens))
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes + missed, out=offsets[1:])
    tokens = np.empty(int(offsets[-1]), dtype=np.int32)
    # the sampled tokens move past the missed ones of their own row and of every row before it
    tokens[np.arange(len(rows.tokens)) + np.repeat(np.cumsum(missed), sizes)] = rows.tokens
    for r, missed_tokens in filled:
        tokens[offsets[r]:offsets[r] + len(missed_tokens)] = missed_tokens
    rows.tokens, rows.offsets, rows.gap_tokens = tokens, offsets, int(missed.sum())
    return rows


def batch_ranks(ids: Sequence[Any], known: dict[Any, int], missing: int, last_ids: Sequence[Any] = (),
                last_ranks: Any = ()) -> tuple[np.ndarray, list[int], list[int], list[Any]]:
    """A vLLM step's request ids as arrival ranks, given the last step's ids and ranks: (ranks,
    misses, entered, left). An id that is the very object at its position in ``last_ids`` keeps
    its rank there; the others (``entered``: their positions) are looked up in ``known``, and get
    ``missing`` where absent (``misses``: their positions). ``left``: the ids of ``last_ids`` that
    are nowhere in ``ids`` (by identity), in order. A batch keeps most ids where they were: after
    a forward each id, dict entry and rank touched is a cache miss, so only the changed positions
    are looked up. One C++ pass where the native core is built."""
    native = native_module() if isinstance(ids, (tuple, list)) and isinstance(last_ids, (tuple, list)) else None
    if native is not None and type(known) is dict:  # it converts the ranks itself (each NumPy call costs)
        ranks, misses, entered, left = native.batch_ranks(ids, known, int(missing), last_ids, last_ranks)
        return ranks, misses, entered, left
    last_ranks = np.asarray(last_ranks, dtype=np.int64).reshape(-1)
    if len(last_ranks) != len(last_ids):
        raise ValueError(f"batch_ranks: {len(last_ranks)} last ranks for {len(last_ids)} last ids")
    ranks = np.empty(len(ids), dtype=np.int64)
    misses: list[int] = []
    entered: list[int] = []
    for i, request_id in enumerate(ids):
        if i < len(last_ids) and request_id is last_ids[i]:
            ranks[i] = last_ranks[i]
            continue
        entered.append(i)
        if request_id in known:
            ranks[i] = known[request_id]
        else:
            ranks[i] = missing
            misses.append(i)
    came = {id(ids[i]) for i in entered}
    left = [request_id for i, request_id in enumerate(last_ids)
            if not (i < len(ids) and ids[i] is request_id) and id(request_id) not in came]
    return ranks, misses, entered, left
