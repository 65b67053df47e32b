"""The per-prompt n-gram drafter.

For a request (prompt id, prompt, output so far) it proposes up to k tokens:

1. **Match.** The request's own tokens live in its prompt's suffix automaton, next to the prompt's
   recent rollouts and its siblings in flight. The state of its whole context there, followed up
   suffix links to the first state that has continuations, is the longest suffix of the context
   that occurred before (in an earlier rollout, a sibling, the prompt or its own earlier output).
   Committing a token extends the request's sequence in O(1) amortised time.
2. **Continuation.** From that state the draft follows, token by token, the continuation that
   followed most often (newest on ties). Where the matched occurrences end, it backs off to a
   shorter suffix and goes on, which also continues loops. The chance that each drafted token is
   the one that follows, given the tokens before it, is estimated from the same counts; the draft
   stops when the product falls under ``min_confidence``.
3. **Cross-prompt fallback.** When other prompts' rollouts match a longer suffix than this
   prompt's history, the draft comes from them instead.

Each draft carries the automaton states it walked through, so the prefetcher can predict the next
draft for any verification outcome without redoing the match.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ngramrl.config import DrafterConfig
from ngramrl.core.automaton import ROOT, SuffixAutomaton
from ngramrl.core.history import RolloutHistory


@dataclass
class Draft:
    tokens: list[int]
    # probs[i]: estimated chance that tokens[i] follows, given the context and tokens[:i].
    probs: list[float] = field(default_factory=list)
    # states[i]: the index state after the context and tokens[:i] (len(tokens) + 1 entries).
    states: list[int] = field(default_factory=list)
    matched: int = 0
    source: str = "none"  # "prompt" (this prompt's history), "global" (other prompts) or "none"
    index: SuffixAutomaton | None = None

    @property
    def expected_accepted(self) -> float:
        """Expected number of accepted tokens under the draft's own probability estimates."""
        total, survive = 0.0, 1.0
        for p in self.probs:
            survive *= p
            total += survive
        return total

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class RequestState:
    """What the drafter tracks for one generating request."""

    request_id: str
    prompt_id: str
    prompt: list[int]
    output: list[int] = field(default_factory=list)
    known: bool = False
    global_build: int = -1
    global_state: int = ROOT
    global_matched: int = 0


class NgramDrafter:
    def __init__(self, history: RolloutHistory, config: DrafterConfig | None = None) -> None:
        self.history = history
        self.config = config or DrafterConfig()

    def start(self, request_id: str, prompt_id: str, prompt: list[int], output: list[int] | None = None) -> RequestState:
        request = RequestState(request_id, prompt_id, list(prompt), list(output or []))
        request.known = self.history.begin_live(prompt_id, request_id, request.output)
        if request.known:
            self.history.live_state(prompt_id, request_id)  # build the index now, not in the first step
        return request

    def commit(self, request: RequestState, tokens: list[int]) -> None:
        """Record tokens the target has committed for this request."""
        request.output.extend(tokens)
        if not request.known:
            return
        self.history.extend_live(request.prompt_id, request.request_id, tokens)
        if self.config.use_global and request.global_build == self.history.global_builds:
            index = self.history.global_index()
            state, matched = request.global_state, request.global_matched
            for token in tokens:
                state, matched = index.step(state, matched, token)
            request.global_state, request.global_matched = state, matched

    def finish(self, request: RequestState, epoch: int | None = None) -> None:
        """The request ended: keep its output as a finished rollout of ``epoch``, or drop it (None)."""
        if request.known:
            self.history.end_live(request.prompt_id, request.request_id, epoch)
            request.known = False

    def propose(self, request: RequestState, k: int | None = None) -> Draft:
        k = self.config.max_draft if k is None else k
        live = self.history.live_state(request.prompt_id, request.request_id) if request.known else None
        if live is None or k <= 0:
            return Draft([])
        index, state = live
        best = self.walk(index, state, k, "prompt")
        if self.config.use_global:
            index = self._global_match(request)
            if request.global_matched > best.matched:
                other = self.walk(index, request.global_state, k, "global", request.global_matched)
                if other.tokens:
                    best = other
        return best

    def _global_match(self, request: RequestState) -> SuffixAutomaton:
        index = self.history.global_index()
        if request.global_build != self.history.global_builds:
            request.global_build = self.history.global_builds
            context = request.prompt + request.output
            request.global_state, request.global_matched = index.match(context[-self.config.rematch_tokens:])
        return index

    def walk(self, index: SuffixAutomaton, state: int, k: int, source: str, matched: int | None = None) -> Draft:
        """Follow the most frequent continuation from ``state`` (backing off where occurrences end).
        ``matched``: how much of the context the state matches, when less than its longest string."""
        link, length, count, num_children = index.link, index.length, index.count, index.num_children
        best_token, best_state, followed = index.best_token, index.best_state, index.followed
        min_match = self.config.min_match
        matched = length[state] if matched is None else min(matched, length[state])
        while best_token[state] < 0 and length[state] > min_match:
            state = link[state]
            matched = length[state]
        if best_token[state] < 0 or matched < min_match:
            return Draft([], matched=matched)
        tokens: list[int] = []
        probs: list[float] = []
        states = [state]
        floor = self.config.min_confidence
        stop = self.config.stop_tokens
        survive = 1.0
        while True:
            token, child = best_token[state], best_state[state]
            # Witten-Bell estimate: unseen continuations get the mass of one per distinct token seen.
            p = count[child] / (followed[state] + num_children(state))
            survive *= p
            if survive < floor:
                break
            tokens.append(token)
            probs.append(p)
            states.append(child)
            if len(tokens) >= k or token in stop:
                break
            state = child
            while best_token[state] < 0 and length[link[state]] >= min_match:
                state = link[state]
            if best_token[state] < 0:
                break
        return Draft(tokens, probs, states, matched, source, index)
