"""Rollout history: per prompt, a bounded window of recent rollouts, indexed for lookup.

Each prompt keeps its most recent finished rollouts (a count and an epoch window) in one suffix
automaton together with its prompt tokens and the live sequences of its requests in flight, so
a request drafts from earlier rollouts, from siblings being generated, and from its own output
with one lookup. A cross-prompt index over all stored rollouts is the estimates' second source.
A global token cap evicts whole prompts, least recently used first.
"""

from __future__ import annotations

import operator
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from ngramrl.config import HistoryConfig
from ngramrl.core.automaton import ROOT, SuffixAutomaton
from ngramrl.core.trace import MAX_TOKEN_ID

_INT = {int}
# A stale cross-prompt index is replaced by one built a little at a time, as rollouts are stored:
# each stored rollout adds this many times its own tokens to the replacement. Built at once, at
# the next lookup, the whole window's build would land on one engine step (hundreds of
# milliseconds at a thousand prompts); this way it runs where rollouts enter the history (the
# native core: in the background, during a forward), and is done after a quarter as many new
# tokens as the window holds, long before the next one is due (when evicted tokens are half).
REBUILD_PACE = 4


def token_ids(tokens: Iterable[int], what: str) -> list[int]:
    """``tokens`` as a list of non-negative ints (NumPy and other integer types are taken), or a
    ValueError that names ``what`` and the first bad position. Cheap on the common path: the
    engine commits a few tokens per row per step."""
    if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__iter__"):
        raise ValueError(f"{what} must be a sequence of token ids, got {tokens!r}")
    out = list(tokens)
    try:
        if not out or (min(out) >= 0 and max(out) <= MAX_TOKEN_ID and set(map(type, out)) <= _INT):
            return out
    except TypeError:  # not comparable with ints: reported below
        pass
    for position, token in enumerate(out):
        if isinstance(token, bool):
            raise ValueError(f"{what}[{position}] is not a token id: {token!r}")
        try:
            value = operator.index(token)
        except TypeError:
            raise ValueError(f"{what}[{position}] is not an integer token id: {token!r}") from None
        if value < 0:
            raise ValueError(f"{what}[{position}] = {value} is negative (token ids are >= 0)")
        if value > MAX_TOKEN_ID:
            raise ValueError(f"{what}[{position}] = {value} is not a 32-bit token id")
        out[position] = value
    return out


def _epoch(epoch: int, what: str) -> int:
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"{what} must be an integer >= 0, got {epoch!r}")
    return epoch


def checked_rollout(prompt: Iterable[int], output: Iterable[int], epoch: int,
                    what: str = "") -> tuple[list[int], list[int], int]:
    """A finished rollout's prompt, output and epoch as ``add_rollout`` stores them, or a
    ValueError that names the bad one (after ``what``, e.g. ``rollouts[3] ``) and its position."""
    return (token_ids(prompt, f"{what}prompt"), token_ids(output, f"{what}output"), _epoch(epoch, f"{what}epoch"))


@dataclass
class _StoredRollout:
    epoch: int
    tokens: list[int]


@dataclass
class PromptHistory:
    prompt_id: str
    prompt: list[int]
    rollouts: deque[_StoredRollout] = field(default_factory=deque)
    live: dict[str, list[int]] = field(default_factory=dict)
    index: SuffixAutomaton | None = None
    cursors: dict[str, int] = field(default_factory=dict)
    lingering: bool = False  # the index still holds ended live sequences (dropped at the next rollout)

    @property
    def rollout_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.rollouts)

    @property
    def stored_tokens(self) -> int:
        return len(self.prompt) + self.rollout_tokens + sum(map(len, self.live.values()))


class RolloutHistory:
    def __init__(self, config: HistoryConfig | None = None) -> None:
        self.config = config or HistoryConfig()
        self._prompts: OrderedDict[str, PromptHistory] = OrderedDict()
        self._live_prompt: dict[str, str] = {}  # request id -> prompt id, for every request in flight
        self._stored = 0
        self.evicted_prompts = 0
        self.rebuilds = 0
        # Bumped whenever prompts may have left (an eviction, ``clear``) or the cross-prompt index
        # may be replaced: a request that found its prompt under the same layout need not find it
        # again, only check that the prompt's own index is the one it holds (``current_index``).
        # One prompt's index being dropped (a window trim, a discard) moves no other request.
        self.layout = 0
        # Cross-prompt index over every stored rollout; built at the first lookup, then replaced
        # as it goes stale (``_global_evicted``).
        self._global: SuffixAutomaton | None = None
        self._global_tokens = 0  # rollout tokens in it
        self._global_stale = 0   # of which evicted since it was built
        # Its replacement while that is built: the index so far, the rollouts still to add
        # (prompt, output) in order, and its own counts.
        self._next_global: SuffixAutomaton | None = None
        self._next_queue: deque[tuple[list[int], list[int]]] = deque()
        self._next_tokens = 0
        self._next_stale = 0
        self.global_builds = 0

    def __contains__(self, prompt_id: str) -> bool:
        return prompt_id in self._prompts

    def __len__(self) -> int:
        return len(self._prompts)

    @property
    def stored_tokens(self) -> int:
        return self._stored

    def prompt_ids(self) -> list[str]:
        return list(self._prompts)

    def rollout_count(self, prompt_id: str) -> int:
        entry = self._prompts.get(prompt_id)
        return len(entry.rollouts) if entry else 0

    # -- finished rollouts ------------------------------------------------------------------

    def add_rollout(self, prompt_id: str, prompt: list[int], output: list[int], epoch: int = 0) -> None:
        """Record a finished rollout; it becomes a draft source for every later request of this prompt."""
        prompt, output, epoch = checked_rollout(prompt, output, epoch)
        entry = self._entry(prompt_id, prompt)
        self._store(entry, epoch, output, index_it=True)

    def _entry(self, prompt_id: str, prompt: list[int]) -> PromptHistory:
        entry = self._prompts.get(prompt_id)
        if entry is None:
            entry = PromptHistory(prompt_id, list(prompt))
            self._prompts[prompt_id] = entry
            self._stored += len(entry.prompt)
        self._prompts.move_to_end(prompt_id)
        return entry

    def _store(self, entry: PromptHistory, epoch: int, tokens: list[int], index_it: bool) -> None:
        entry.rollouts.append(_StoredRollout(epoch, tokens))
        self._stored += len(tokens)
        evicted = self._trim_window(entry)
        if evicted or entry.lingering:
            entry.lingering = False
            entry.index = None  # rebuilt lazily on the next lookup
        elif index_it and entry.index is not None:
            entry.index.add_sequence(self.sequence(entry.prompt, tokens))
        if self._global is not None:
            if self._next_global is not None:
                self._next_queue.append((entry.prompt, tokens))
            self._global_evicted(evicted)  # a replacement it starts finds this rollout in the window
            self._global.add_sequence(self.sequence(entry.prompt, tokens))
            self._global_tokens += len(tokens)
            self._build_next_global(REBUILD_PACE * len(tokens))
        elif index_it:
            self.layout += 1  # a new cross-prompt index will be built
        self._enforce_cap()

    def _global_evicted(self, tokens: int) -> None:
        """Evicted rollouts stay in the cross-prompt index until they are half of it; then a
        replacement over the current windows is started, built as rollouts are stored
        (``_build_next_global``), and the index in use serves until it is done. Rebuilding it at
        every eviction would cost the whole history each time a prompt's window moves on (once per
        prompt per epoch); this way a rebuild costs O(1) per evicted token, and the fallback only
        drafts from a little more than the window."""
        self._global_stale += tokens
        if self._next_global is not None:
            self._next_stale += tokens  # the replacement holds them too (added, or still to add)
        elif 2 * self._global_stale > self._global_tokens:
            self._next_global = SuffixAutomaton()
            self._next_queue = deque((entry.prompt, rollout.tokens) for entry in self._prompts.values()
                                     for rollout in entry.rollouts)
            self._next_tokens = self._next_stale = 0

    def _build_next_global(self, budget: int) -> None:
        """Add rollouts to the replacement until ``budget`` tokens (one at least); once it holds
        them all it becomes the cross-prompt index."""
        index = self._next_global
        if index is None:
            return
        queue = self._next_queue
        while queue:
            prompt, tokens = queue.popleft()
            index.add_sequence(self.sequence(prompt, tokens))
            self._next_tokens += len(tokens)
            budget -= len(tokens)
            if budget <= 0:
                break
        if not queue:
            self._global, self._global_tokens, self._global_stale = index, self._next_tokens, self._next_stale
            self._next_global = None
            self.global_builds += 1
            self.layout += 1

    def _trim_window(self, entry: PromptHistory) -> int:
        """Drop the rollouts that left the prompt's window; returns how many tokens went."""
        newest = max(r.epoch for r in entry.rollouts)
        evicted = 0
        while entry.rollouts and (
            len(entry.rollouts) > self.config.rollouts_per_prompt
            or entry.rollouts[0].epoch <= newest - self.config.epochs_kept
        ):
            gone = len(entry.rollouts.popleft().tokens)
            self._stored -= gone
            evicted += gone
        return evicted

    def _enforce_cap(self) -> None:
        while self._stored > self.config.max_tokens and len(self._prompts) > 1:
            _, entry = self._prompts.popitem(last=False)
            self._stored -= entry.stored_tokens
            for request_id in entry.live:  # they go on without drafts; their ids are free again
                self._live_prompt.pop(request_id, None)
            self.evicted_prompts += 1
            self.layout += 1
            if self._global is not None:
                self._global_evicted(entry.rollout_tokens)

    def sequence(self, prompt: list[int], output: list[int]) -> list[int]:
        """What is indexed for an output: the prompt's last tokens first, so its opening is draftable."""
        tail = prompt[len(prompt) - self.config.prompt_tail:] if self.config.prompt_tail else []
        return tail + list(output)

    # -- requests in flight -----------------------------------------------------------------

    def begin_live(self, prompt_id: str, request_id: str, output: list[int] | None = None,
                   prompt: list[int] | None = None) -> bool:
        """A request starts: its tokens become visible to itself and its siblings. An unknown prompt
        is registered when its tokens are given; otherwise returns False (nothing to draft from).
        A request id may be in flight only once."""
        if request_id in self._live_prompt:
            raise ValueError(f"request id {request_id!r} is already in flight (for prompt "
                             f"{self._live_prompt[request_id]!r}): finish it before starting another with that id")
        entry = self._prompts.get(prompt_id)
        if entry is None:
            if prompt is None:
                return False
            entry = self._entry(prompt_id, prompt)
        entry.live[request_id] = list(output or [])
        self._live_prompt[request_id] = prompt_id
        self._stored += len(entry.live[request_id])
        if entry.index is not None:
            entry.cursors[request_id] = entry.index.add_sequence(self.sequence(entry.prompt, entry.live[request_id]))
        return True

    def extend_live(self, prompt_id: str, request_id: str, tokens: list[int]) -> None:
        entry = self._prompts.get(prompt_id)
        if entry is None or request_id not in entry.live:
            return
        entry.live[request_id].extend(tokens)
        self._stored += len(tokens)
        cursor = entry.cursors.get(request_id)
        if entry.index is not None and cursor is not None:
            extend = entry.index.extend
            for token in tokens:
                cursor = extend(cursor, token)
            entry.cursors[request_id] = cursor

    def end_live(self, prompt_id: str, request_id: str, epoch: int | None = None, linger: bool = False) -> None:
        """A request ends. With an epoch its output is kept as a finished rollout (already indexed);
        without one it is discarded and the index is rebuilt without it on the next lookup, or, with
        ``linger``, when the prompt's next finished rollout arrives (its siblings still in flight
        keep drafting from it meanwhile, and no rebuild happens in the middle of generation)."""
        entry = self._prompts.get(prompt_id)
        if entry is None or request_id not in entry.live:
            return
        tokens = entry.live.pop(request_id)
        self._live_prompt.pop(request_id, None)
        self._stored -= len(tokens)
        entry.cursors.pop(request_id, None)
        if epoch is None and linger:
            entry.lingering = entry.lingering or (bool(tokens) and entry.index is not None)
        elif epoch is None:
            if tokens or entry.index is not None:
                entry.index = None
        else:
            self._store(entry, epoch, tokens, index_it=False)

    def drop_ended(self, prompt_id: str) -> None:
        """The outputs of requests that ended lingering leave the prompt's index now (rebuilt from
        the window and the live requests at its next lookup), not at its next finished rollout.
        Neither the prompt's recency nor any other index moves."""
        entry = self._prompts.get(prompt_id)
        if entry is not None and entry.lingering:
            entry.lingering = False
            entry.index = None

    def live_state(self, prompt_id: str, request_id: str) -> tuple[SuffixAutomaton, int] | None:
        """The prompt's index and the state of the request's whole context in it (rebuilding if needed)."""
        entry = self._prompts.get(prompt_id)
        if entry is None or request_id not in entry.live:
            return None
        return self._indexed(entry), entry.cursors[request_id]

    def is_live(self, prompt_id: str, request_id: str) -> bool:
        entry = self._prompts.get(prompt_id)
        return entry is not None and request_id in entry.live

    def cursor(self, prompt_id: str, request_id: str) -> int:
        """State of the request's own sequence in its prompt's current index."""
        return self._prompts[prompt_id].cursors[request_id]

    def current_index(self, prompt_id: str) -> SuffixAutomaton | None:
        """The prompt's index as it is (None if it was dropped or the prompt is unknown): neither
        built nor touched."""
        entry = self._prompts.get(prompt_id)
        return None if entry is None else entry.index

    def index_of(self, prompt_id: str) -> SuffixAutomaton | None:
        """The prompt's index (built if needed), or None for an unknown prompt."""
        entry = self._prompts.get(prompt_id)
        return None if entry is None else self._indexed(entry)

    def _indexed(self, entry: PromptHistory) -> SuffixAutomaton:
        self._prompts.move_to_end(entry.prompt_id)
        if entry.index is None:
            self._rebuild(entry)
        assert entry.index is not None
        return entry.index

    def _rebuild(self, entry: PromptHistory) -> None:
        index = SuffixAutomaton()
        index.add_sequence(entry.prompt)
        for rollout in entry.rollouts:
            index.add_sequence(self.sequence(entry.prompt, rollout.tokens))
        entry.cursors = {rid: index.add_sequence(self.sequence(entry.prompt, toks)) for rid, toks in entry.live.items()}
        entry.index = index
        entry.lingering = False
        self.rebuilds += 1

    # -- saving -------------------------------------------------------------------------------

    def export(self, prompt_ids: list[str] | None = None) -> list[list]:
        """The finished rollouts, oldest prompt first: [prompt_id, prompt, [[epoch, output], ...]];
        ``prompt_ids``: only the known ones among them, in that order."""
        entries = (self._prompts.values() if prompt_ids is None
                   else [self._prompts[p] for p in prompt_ids if p in self._prompts])
        return [[entry.prompt_id, list(entry.prompt), [[r.epoch, list(r.tokens)] for r in entry.rollouts]]
                for entry in entries]

    def clear(self) -> None:
        """Forget every prompt and rollout (a request still live goes on without drafts)."""
        self._prompts.clear()
        self._live_prompt.clear()
        self._stored = 0
        self._global, self._global_tokens, self._global_stale = None, 0, 0
        self._next_global, self._next_queue, self._next_tokens, self._next_stale = None, deque(), 0, 0
        self.layout += 1

    def restore(self, exported: list[list], replace: bool = False) -> None:
        """Add what ``export`` returned, in its order (so windows and recency come out the same);
        ``replace``: each prompt's rollouts in place of those it had (its live sequences stay)."""
        for prompt_id, prompt, rollouts in exported:
            if not isinstance(prompt_id, str):
                raise ValueError(f"prompt id {prompt_id!r} is not a string")
            prompt = token_ids(prompt, f"prompt of {prompt_id!r}")
            what = f"rollout of {prompt_id!r}"
            # every rollout checked before the prompt's window changes
            window = [(_epoch(epoch, f"epoch of a {what}"), token_ids(tokens, what)) for epoch, tokens in rollouts]
            entry = self._entry(prompt_id, prompt)
            if replace:
                self._drop_rollouts(entry)
            for epoch, tokens in window:
                self._store(entry, epoch, tokens, index_it=True)

    def _drop_rollouts(self, entry: PromptHistory) -> None:
        """The prompt's window empties; the cross-prompt index counts its tokens as evicted."""
        tokens = entry.rollout_tokens
        entry.rollouts.clear()
        self._stored -= tokens
        entry.index = None
        entry.lingering = False
        if self._global is not None:
            self._global_evicted(tokens)

    def built_global_index(self) -> SuffixAutomaton | None:
        """The cross-prompt index if it is built, without building it."""
        return self._global

    def global_index(self) -> SuffixAutomaton:
        if self._global is None:
            index = SuffixAutomaton()
            tokens = 0
            for entry in self._prompts.values():
                for rollout in entry.rollouts:
                    index.add_sequence(self.sequence(entry.prompt, rollout.tokens))
                    tokens += len(rollout.tokens)
            self._global, self._global_tokens, self._global_stale = index, tokens, 0
            self.global_builds += 1
        return self._global


__all__ = ["RolloutHistory", "PromptHistory", "ROOT", "token_ids"]
