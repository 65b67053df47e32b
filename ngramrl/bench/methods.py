"""Drafting methods as the replay benchmark drives them.

Every method sees, for a rollout of epoch e, only what was known before epoch e started (all
rollouts of earlier epochs) plus the rollout's own prompt and its own output committed so far.
The replay loop calls ``begin_epoch`` with the earlier epochs' rollouts, then for each replayed
rollout ``start``, and per step ``propose`` and ``commit``, then ``finish``.
"""

from __future__ import annotations

from typing import Protocol

from ngramrl.config import DrafterConfig, HistoryConfig
from ngramrl.core.automaton import SuffixAutomaton
from ngramrl.core.drafter import NgramDrafter, RequestState
from ngramrl.core.history import RolloutHistory
from ngramrl.core.trace import Rollout


class ReplayMethod(Protocol):
    name: str

    def add_history(self, rollouts: list[Rollout]) -> None: ...
    def start(self, rollout: Rollout) -> None: ...
    def propose(self, k: int) -> list[int]: ...
    def commit(self, tokens: list[int]) -> None: ...
    def finish(self) -> None: ...


class NoDraft:
    name = "none"

    def add_history(self, rollouts: list[Rollout]) -> None:
        pass

    def start(self, rollout: Rollout) -> None:
        pass

    def propose(self, k: int) -> list[int]:
        return []

    def commit(self, tokens: list[int]) -> None:
        pass

    def finish(self) -> None:
        pass


class NgramRLMethod:
    name = "ngramrl"

    def __init__(self, history: HistoryConfig | None = None, drafter: DrafterConfig | None = None) -> None:
        self.history = RolloutHistory(history)
        self.drafter = NgramDrafter(self.history, drafter)
        self.request: RequestState | None = None
        self.last_draft = None

    def add_history(self, rollouts: list[Rollout]) -> None:
        for rollout in rollouts:
            self.history.add_rollout(rollout.prompt_id, rollout.prompt, rollout.output, rollout.epoch)

    def start(self, rollout: Rollout) -> None:
        self.request = self.drafter.start(f"{rollout.prompt_id}/{rollout.epoch}/{rollout.sample}",
                                          rollout.prompt_id, rollout.prompt)

    def propose(self, k: int) -> list[int]:
        assert self.request is not None
        self.last_draft = self.drafter.propose(self.request, k)
        return self.last_draft.tokens

    def commit(self, tokens: list[int]) -> None:
        assert self.request is not None
        self.drafter.commit(self.request, tokens)

    def finish(self) -> None:
        # Same-epoch rollouts must not see each other: drop this one; add_history adds the epoch later.
        assert self.request is not None
        self.drafter.finish(self.request, epoch=None)
        self.request = None


class SuffixMethod:
    """SuffixDecoding through the real arctic-inference cache, with vLLM's ``suffix`` defaults."""

    name = "suffix"

    def __init__(self, max_tree_depth: int = 24, max_spec_factor: float = 1.0, min_token_prob: float = 0.1) -> None:
        try:
            from arctic_inference.suffix_decoding import SuffixDecodingCache
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise RuntimeError(
                "method 'suffix' needs arctic-inference (see README: install with the [suffix] extra)"
            ) from err
        self.cache = SuffixDecodingCache(max_tree_depth=max_tree_depth, max_cached_requests=-1)
        self.depth = max_tree_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._next_id = 0
        self.request_id: int | None = None
        self.context: list[int] = []

    def add_history(self, rollouts: list[Rollout]) -> None:
        for rollout in rollouts:
            rid = self._new_id()
            self.cache.start_request(rid, rollout.prompt)
            if rollout.output:
                self.cache.add_active_response(rid, rollout.output)
            self.cache.stop_request(rid)  # the response stays cached for later requests

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def start(self, rollout: Rollout) -> None:
        self.request_id = self._new_id()
        self.cache.start_request(self.request_id, rollout.prompt)
        self.context = list(rollout.prompt)

    def propose(self, k: int) -> list[int]:
        draft = self.cache.speculate(self.request_id, self.context[-self.depth:], max_spec_tokens=k,
                                     max_spec_factor=self.max_spec_factor, min_token_prob=self.min_token_prob)
        return list(draft.token_ids)

    def commit(self, tokens: list[int]) -> None:
        self.context.extend(tokens)
        self.cache.add_active_response(self.request_id, tokens)

    def finish(self) -> None:
        # The replayed rollout must not be visible to rollouts of its own epoch: drop it from the cache.
        self.cache.stop_request(self.request_id)
        self.cache.evict_cached_response(self.request_id)
        self.request_id = None


def prompt_lookup(tokens: list[int], min_ngram: int, max_ngram: int, k: int) -> list[int]:
    """vLLM's n-gram proposer: the longest suffix n-gram (min..max) seen earlier in the context,
    ties going to its earliest occurrence, and the up to k tokens that followed it."""
    total = len(tokens)
    if total < min_ngram or k <= 0:
        return []
    reverse = tokens[::-1]
    # KMP prefix function of the reversed context, capped at max_ngram: prefix matches of the
    # reversed context are suffix matches of the context.
    lps = [0] * max_ngram
    longest, position, prev = 0, 0, 0
    i = 1
    while i < total:
        if reverse[prev] == reverse[i]:
            prev += 1
            if prev >= longest:
                longest, position = prev, i
            if i < max_ngram:
                lps[i] = prev
            if prev == max_ngram:
                prev = lps[max_ngram - 1]
            i += 1
        elif prev != 0:
            prev = lps[prev - 1]
        else:
            i += 1
    if longest < min_ngram:
        return []
    start = total - 1 - position + longest
    return tokens[start:start + min(k, total - start)]


class PromptLookupMethod:
    name = "pld"

    def __init__(self, min_ngram: int = 2, max_ngram: int = 5) -> None:
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.context: list[int] = []

    def add_history(self, rollouts: list[Rollout]) -> None:
        pass  # prompt lookup only reads the request's own context

    def start(self, rollout: Rollout) -> None:
        self.context = list(rollout.prompt)

    def propose(self, k: int) -> list[int]:
        return prompt_lookup(self.context, self.min_ngram, self.max_ngram, k)

    def commit(self, tokens: list[int]) -> None:
        self.context.extend(tokens)

    def finish(self) -> None:
        pass


class OracleMethod:
    """Ceiling, not a drafter: the longest run of the true next tokens that follows any allowed
    position whose token equals the context's last token (earlier epochs' rollouts with their
    prompts, the request's own prompt and output; a copy from its own context may overlap the
    tokens it predicts, as a repeating loop does)."""

    name = "oracle"

    def __init__(self) -> None:
        self.index = SuffixAutomaton()
        self.truth: list[int] = []
        self.context: list[int] = []
        self.positions: dict[int, list[int]] = {}
        self.done = 0

    def add_history(self, rollouts: list[Rollout]) -> None:
        for rollout in rollouts:
            self.index.add_sequence(rollout.prompt + rollout.output)

    def start(self, rollout: Rollout) -> None:
        self.truth = rollout.output
        self.context = list(rollout.prompt)
        self.positions = {}
        for pos, token in enumerate(self.context):
            self.positions.setdefault(token, []).append(pos)
        self.done = 0

    def _history_run(self, last: int, future: list[int]) -> int:
        """Walk the automaton along (last, future...) while the string stays a substring."""
        child = self.index.child
        state = child(0, last)
        run = 0
        if state >= 0:
            for token in future:
                state = child(state, token)
                if state < 0:
                    break
                run += 1
        return run

    def propose(self, k: int) -> list[int]:
        future = self.truth[self.done:self.done + k]
        last = self.context[-1]
        best = self._history_run(last, future)
        # Own context, overlapping copies allowed: ext = context + future.
        if best < len(future):
            context = self.context
            n = len(context)
            for p in self.positions.get(last, ()):
                if p == n - 1:
                    continue
                length = 0
                while length < len(future):
                    src = p + 1 + length
                    token = context[src] if src < n else future[src - n]
                    if token != future[length]:
                        break
                    length += 1
                if length > best:
                    best = length
                    if best == len(future):
                        break
        return future[:best]

    def commit(self, tokens: list[int]) -> None:
        for token in tokens:
            self.positions.setdefault(token, []).append(len(self.context))
            self.context.append(token)
        self.done += len(tokens)

    def finish(self) -> None:
        pass


class PromptOracleMethod(OracleMethod):
    """A tighter ceiling for history drafting: the best continuation copied after a one-token match
    in the same prompt's earlier rollouts only (no other prompts, no own context)."""

    name = "oracle-prompt"

    def __init__(self) -> None:
        super().__init__()
        self.per_prompt: dict[str, SuffixAutomaton] = {}

    def add_history(self, rollouts: list[Rollout]) -> None:
        for rollout in rollouts:
            self.per_prompt.setdefault(rollout.prompt_id, SuffixAutomaton()).add_sequence(rollout.output)

    def start(self, rollout: Rollout) -> None:
        super().start(rollout)
        self.index = self.per_prompt.get(rollout.prompt_id) or SuffixAutomaton()

    def propose(self, k: int) -> list[int]:
        future = self.truth[self.done:self.done + k]
        return future[:self._history_run(self.context[-1], future)]


METHOD_NAMES = ("ngramrl", "suffix", "pld", "none", "oracle", "oracle-prompt")


def make_method(name: str, drafter: DrafterConfig | None = None, history: HistoryConfig | None = None) -> ReplayMethod:
    if name == "ngramrl":
        return NgramRLMethod(history, drafter)
    if name == "suffix":
        return SuffixMethod()
    if name == "pld":
        return PromptLookupMethod()
    if name == "none":
        return NoDraft()
    if name == "oracle":
        return OracleMethod()
    if name == "oracle-prompt":
        return PromptOracleMethod()
    raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHOD_NAMES)}")
