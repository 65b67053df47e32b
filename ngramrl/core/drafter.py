"""The per-prompt n-gram drafter.

For a request (prompt id, prompt, output so far) it proposes up to k tokens:

1. **Match.** The request's own tokens live in its prompt's suffix automaton, next to the prompt's
   recent rollouts and its siblings in flight. The request keeps its match state there: the longest
   suffix of its context seen in that index, and how long it is. Committing tokens moves the state
   in O(1) amortised time per token.
2. **Estimate.** The chance that each token follows comes from ``continuation_estimates``
   (``ngramrl/core/estimate.py``): the suffix levels of the context in this prompt's index,
   interpolated longest first (Witten-Bell), then other prompts' rollouts (the cross-prompt
   index) for the mass this prompt's history leaves unexplained.
3. **Chain.** The draft takes the likeliest token, steps the match states by it, and goes on
   (``extend_path``): where occurrences end shorter contexts take over, which also continues
   loops. It stops after k tokens, at a stop token, where nothing is known, or when the product of
   the estimates falls under ``min_confidence``. With ``path_width`` > 1 the path is chosen by
   expected accepted length in a best-first draft tree first (``ngramrl/core/tree.py``), and
   ``lookup_tree`` returns such a tree itself.

The request's own committed tokens enter its prompt's index right after the next draft was made
(``absorb``), never in between: so the next draft is a pure function of the index and the tokens
committed, and a prefetcher that knows the outcome in advance computes exactly the same draft.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ngramrl.config import DrafterConfig
from ngramrl.core.automaton import SuffixAutomaton
from ngramrl.core.estimate import MatchState, Source, advance
from ngramrl.core.history import RolloutHistory, token_ids
from ngramrl.core.tree import Chance, DraftTree, extend_path, grow_tree, path_chain


@dataclass
class Draft:
    tokens: list[int]
    # probs[i]: estimated chance that tokens[i] follows, given the context and tokens[:i].
    probs: list[float] = field(default_factory=list)
    matched: int = 0
    source: str = "none"  # "prompt" (this prompt's history), "global" (other prompts) or "none"

    def __len__(self) -> int:
        return len(self.tokens)

    def truncated(self, length: int) -> Draft:
        return Draft(self.tokens[:length], self.probs[:length], self.matched, self.source)

    @property
    def expected_accepted(self) -> float:
        """Expected number of accepted tokens under the draft's own probability estimates."""
        total, survive = 0.0, 1.0
        for p in self.probs:
            survive *= p
            total += survive
        return total


EMPTY = Draft([])


@dataclass
class RequestState:
    """What the drafter tracks for one generating request."""

    request_id: str
    prompt_id: str
    prompt: list[int]
    output: list[int] = field(default_factory=list)
    known: bool = False
    index: SuffixAutomaton | None = None      # the prompt index the match state refers to
    match: MatchState = field(default_factory=MatchState)
    pending: list[int] = field(default_factory=list)  # committed, not yet in the index
    behind: list[int] = field(default_factory=list)   # committed, not yet stepped into ``match``
    global_index: SuffixAutomaton | None = None
    global_match: MatchState = field(default_factory=MatchState)
    global_behind: list[int] = field(default_factory=list)  # committed, not yet stepped into ``global_match``
    layout: int = -1  # history layout the prompt was last found under


class NgramDrafter:
    def __init__(self, history: RolloutHistory, config: DrafterConfig | None = None) -> None:
        self.history = history
        self.config = config or DrafterConfig()

    # -- request life cycle -----------------------------------------------------------------

    def start(self, request_id: str, prompt_id: str, prompt: list[int],
              output: list[int] | None = None, register: bool = True) -> RequestState:
        """A request starts (``output``: tokens it already generated). A prompt never seen is added
        to the history now, so its request drafts from its own output and its siblings' at once,
        and its finished rollouts become history (``finish`` with an epoch). ``register=False``
        leaves an unknown prompt out: its request drafts nothing and leaves nothing behind (for a
        caller whose requests may draft only from the prompts it gave history for). A request id
        may be in flight only once."""
        if not isinstance(request_id, str) or not isinstance(prompt_id, str):
            raise ValueError(f"request and prompt ids must be strings, got {request_id!r} and {prompt_id!r}")
        request = RequestState(request_id, prompt_id, token_ids(prompt, "prompt"), token_ids(output or [], "output"))
        request.known = self.history.begin_live(prompt_id, request_id, request.output,
                                                request.prompt if register else None)
        if request.known:
            self.index(request)  # build the index now, not in the first step
        return request

    def commit(self, request: RequestState, tokens: list[int]) -> None:
        """Tokens the target committed (accepted draft tokens and the one it emitted)."""
        tokens = token_ids(tokens, "committed tokens")
        request.output.extend(tokens)
        if not request.known:
            return
        self.absorb(request)
        index = self.index(request)
        if index is None:
            return
        # The match states are stepped on only when a lookup needs them: a request that is not
        # drafted this step (drafting off at a large batch) pays for the index insert alone.
        request.pending = list(tokens)
        request.behind = list(tokens)
        if request.global_index is not None:
            request.global_behind.extend(tokens)

    def defer(self, request: RequestState, tokens: list[int]) -> None:
        """Tokens committed in a step that makes no lookup: kept but not indexed yet. The next
        ``commit`` or ``absorb`` (before a lookup, or when the request finishes) indexes them in
        one go. Where drafting does not pay (large batches on CPUs) lookups are rare, and inserting
        a backlog at once costs a fraction of inserting each token after every forward, when the
        automaton has left the caches."""
        tokens = token_ids(tokens, "committed tokens")
        request.output.extend(tokens)
        if not request.known:
            return
        request.pending.extend(tokens)
        request.behind.extend(tokens)
        if request.global_index is not None:
            request.global_behind.extend(tokens)

    def catch_up(self, request: RequestState, index: SuffixAutomaton | None = None) -> None:
        """Step the match states over the tokens committed since they were last needed (a lookup
        does this itself; the outcome model reads the states as they are)."""
        index = index or request.index
        if index is None:
            return
        if request.behind:
            request.match = advance(index, request.match, request.behind)
            request.behind = []
        behind = request.global_behind
        if behind and request.global_index is not None:
            request.global_behind = []
            if request.global_index is not self.history.global_index():
                request.global_index = None  # re-matched on the next lookup
            elif len(behind) > self.config.rematch_tokens:  # re-reading the recent context is cheaper
                context = request.prompt + request.output
                request.global_match = advance(request.global_index, MatchState(),
                                               context[-self.config.rematch_tokens:])
            else:
                request.global_match = advance(request.global_index, request.global_match, behind)

    def absorb(self, request: RequestState) -> None:
        """Add the request's committed tokens to its prompt's index (after its next draft is made).
        The request then holds its prompt's current index, as ``index`` would find it: where the
        index was rebuilt (the prompt's window moved on), a prefetch can read the new one at once."""
        if request.known and request.pending:
            tokens, request.pending = request.pending, []
            self.history.extend_live(request.prompt_id, request.request_id, tokens)
            index = self.history.index_of(request.prompt_id)
            if index is None or not self.history.is_live(request.prompt_id, request.request_id):
                return  # its prompt was evicted: ``index`` finds out at the next lookup
            request.layout = self.history.layout
            self._hold(request, index)

    def finish(self, request: RequestState, epoch: int | None = None, linger: bool = False) -> None:
        """The request ended: keep its output as a finished rollout of ``epoch``, or drop it (None;
        with ``linger`` it stays in the index until the prompt's next finished rollout arrives)."""
        if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0):
            raise ValueError(f"epoch must be an integer >= 0 or None, got {epoch!r}")
        if request.known:
            self.absorb(request)
            self.history.end_live(request.prompt_id, request.request_id, epoch, linger=linger)
            request.known = False

    def holds_current_index(self, request: RequestState) -> bool:
        """Whether the index the request holds is still its prompt's: no prompt left the history
        since the request found it, and its prompt's own index was not dropped since."""
        return (request.layout == self.history.layout and request.index is not None
                and self.history.current_index(request.prompt_id) is request.index)

    def _hold(self, request: RequestState, index: SuffixAutomaton) -> None:
        """The request takes ``index`` (its prompt's, where it is live): its match state is its own
        sequence's end state there, advanced over the tokens not inserted yet."""
        request.index = index
        cursor = self.history.cursor(request.prompt_id, request.request_id)
        request.match = advance(index, MatchState(cursor, index.length[cursor]), request.pending)
        request.behind = []

    def index(self, request: RequestState) -> SuffixAutomaton | None:
        """The prompt's current index; the match state is recomputed if the index was rebuilt. If
        the prompt was evicted meanwhile, the request goes on without drafts (None)."""
        if self.holds_current_index(request):
            return request.index
        request.layout = self.history.layout
        index = self.history.index_of(request.prompt_id)
        if index is None or not self.history.is_live(request.prompt_id, request.request_id):
            request.known = False
            request.index = None
            return None
        if index is not request.index:
            self._hold(request, index)
        return index

    def outcome_sources(self, request: RequestState) -> list[tuple[SuffixAutomaton, MatchState]]:
        """Where the outcome model reads what may follow the request's context: its prompt's index,
        then the cross-prompt index when the request is matched in the current one (both as of
        its last lookup; nothing is rebuilt here, so a prefetch thread may call it)."""
        index = request.index
        if not request.known or index is None or request.behind:
            return []  # not looked up since its last tokens: no current match state to read
        sources = [(index, request.match)]
        if (self.config.use_global and request.global_index is not None and not request.global_behind
                and request.global_index is self.history.built_global_index()):
            sources.append((request.global_index, request.global_match))
        return sources

    # -- drafting ---------------------------------------------------------------------------

    def propose(self, request: RequestState, k: int | None = None) -> Draft:
        """The draft for the request's current context; then its pending tokens enter the index."""
        draft = self.lookup(request, k)
        self.absorb(request)
        return draft

    def lookup(self, request: RequestState, k: int | None = None, after: list[int] | None = None,
               at: tuple[int, list[MatchState]] | None = None) -> Draft:
        """The draft for the current context followed by ``after`` (a predicted outcome), without
        changing the request: the prefetcher's lookup and the synchronous one are the same code.
        ``at`` = (n, states): the match states after the context and ``after[:n]``, one per source
        of ``outcome_sources`` (computed ahead by the outcome model), so only the rest is stepped."""
        k = self.config.max_draft if k is None else k
        if k <= 0:
            return EMPTY
        sources = self.sources(request, after, at)
        return self.chain(sources, k) if sources else EMPTY

    def lookup_tree(self, request: RequestState, k: int, width: int, after: list[int] | None = None,
                    chance: Chance | None = None) -> DraftTree:
        """A draft tree of at most ``k`` tokens and ``width`` root-to-leaf paths for the current
        context followed by ``after``, without changing the request (``chance``: as ``grow_tree``'s)."""
        sources = self.sources(request, after) if k > 0 else []
        if not sources:
            return DraftTree()
        config = self.config
        tree, _ = grow_tree(sources, k, width, config.levels, config.min_match, config.min_confidence,
                            config.stop_tokens, chance)
        tree.matched = sources[0][1].matched
        return tree

    def sources(self, request: RequestState, after: list[int] | None = None,
                at: tuple[int, list[MatchState]] | None = None) -> list[Source]:
        """The match states of the context followed by ``after`` in the prompt's index and, with
        ``use_global``, the cross-prompt index ([] for a request without drafts)."""
        if not request.known:
            return []
        index = self.index(request)
        if index is None:
            return []
        self.catch_up(request, index)
        after = after or []
        skip, states = at if at is not None else (0, [])
        if states:
            match = advance(index, states[0], after[skip:])
        else:
            match = advance(index, request.match, after) if after else request.match
        sources: list[Source] = [(index, match)]
        if self.config.use_global:
            global_index = self.history.global_index()
            if request.global_index is not global_index:
                request.global_index = global_index
                context = request.prompt + request.output
                request.global_match = advance(global_index, MatchState(), context[-self.config.rematch_tokens:])
                states = states[:1]  # a state ahead in the old cross-prompt index means nothing now
            if len(states) > 1:
                global_match = advance(global_index, states[1], after[skip:])
            else:
                global_match = advance(global_index, request.global_match, after) if after else request.global_match
            sources.append((global_index, global_match))
        return sources

    def chain(self, sources: list[Source], k: int) -> Draft:
        """The chain draft from match states ``sources``: the root path of largest expected accepted
        length in the best-first tree of ``k`` nodes and ``path_width`` paths, continued with the
        likeliest token at each step up to ``k`` tokens."""
        config = self.config
        if config.path_width == 1:  # the tree of width 1 is this chain, without the tree's bookkeeping
            tokens, probs = extend_path(sources, 1.0, k, config.levels, config.min_match, config.min_confidence,
                                        config.stop_tokens)
            source = self._source_of(sources, tokens[0]) if tokens else "none"
            return Draft(tokens, probs, sources[0][1].matched, source)
        tokens, probs = path_chain(sources, k, config.path_width, config.levels, config.min_match,
                                   config.min_confidence, config.stop_tokens)
        if not tokens:
            return Draft([], matched=sources[0][1].matched)
        return Draft(tokens, probs, sources[0][1].matched, self._source_of(sources, tokens[0]))

    def _source_of(self, sources: list[Source], token: int) -> str:
        """"prompt" when the prompt's index has seen ``token`` after one of the context's suffix
        levels the estimate reads, else "global"."""
        index, match = sources[0]
        state, used = match.state, 0
        if match.matched >= self.config.min_match:
            while used < self.config.levels and index.length[state] >= self.config.min_match:
                if index.num_children(state):
                    used += 1
                    if index.child(state, token) >= 0:
                        return "prompt"
                state = index.link[state]
        return "global"
