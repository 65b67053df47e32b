"""A generalized suffix automaton over token sequences, built online.

It is the index behind every lookup of the drafter: the state reached by reading a context is the
longest suffix of that context seen anywhere in the indexed sequences, extending a match by one
token is O(1) amortised, and the transitions out of a state are exactly the tokens that followed
that suffix, each with its number of occurrences. Sequences can be appended token by token while
others are in progress (sibling samples), so one automaton serves a whole prompt.

Each state also keeps its most frequent continuation (newest on ties) and the number of
occurrences that continued at all, updated incrementally as tokens arrive, so reading the best
continuation is O(1) however many different tokens followed.

The states live in flat lists (no object per state) to keep memory per token low.
"""

from __future__ import annotations

ROOT = 0
NO_TOKEN = -1


class SuffixAutomaton:
    __slots__ = ("next", "link", "length", "count", "best_token", "best_state", "followed", "num_tokens",
                 "num_sequences", "_ranked")

    def __init__(self) -> None:
        # Transitions: most states have exactly one continuation, kept only in best_token/best_state;
        # ``next[state]`` is a dict only once a second one appears (a dict per state would triple memory).
        self.next: list[dict[int, int] | None] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.count: list[int] = [0]              # occurrences: size of the state's end-position set
        self.best_token: list[int] = [NO_TOKEN]  # most frequent continuation (newest on ties)
        self.best_state: list[int] = [-1]
        self.followed: list[int] = [0]           # occurrences that some token followed
        self.num_tokens = 0
        self.num_sequences = 0
        # state -> (followed[state] when ranked, continuations ranked): ``followed`` grows whenever
        # any continuation of the state does, so it stamps the ranking's freshness exactly.
        self._ranked: dict[int, tuple[int, list[tuple[int, int]]]] = {}

    @property
    def num_states(self) -> int:
        return len(self.length)

    def child(self, state: int, token: int) -> int:
        """The state after ``token`` from ``state``, or -1."""
        children = self.next[state]
        if children is None:
            return self.best_state[state] if self.best_token[state] == token else -1
        return children.get(token, -1)

    def children(self, state: int) -> dict[int, int]:
        children = self.next[state]
        if children is None:
            token = self.best_token[state]
            return {} if token < 0 else {token: self.best_state[state]}
        return children

    def num_children(self, state: int) -> int:
        children = self.next[state]
        if children is None:
            return 0 if self.best_token[state] < 0 else 1
        return len(children)

    def _set_child(self, state: int, token: int, target: int) -> None:
        children = self.next[state]
        if children is not None:
            children[token] = target
            if self.best_token[state] == token:
                self.best_state[state] = target
        elif self.best_token[state] < 0:
            self.best_token[state] = token
            self.best_state[state] = target
        elif self.best_token[state] == token:
            self.best_state[state] = target
        else:
            self.next[state] = {self.best_token[state]: self.best_state[state], token: target}

    def new_sequence(self) -> int:
        """Start a sequence; returns its cursor (the state of everything appended so far)."""
        self.num_sequences += 1
        return ROOT

    def add_sequence(self, tokens: list[int]) -> int:
        cursor = self.new_sequence()
        for token in tokens:
            cursor = self.extend(cursor, token)
        return cursor

    def _new_state(self, length: int, link: int) -> int:
        self.next.append(None)
        self.link.append(link)
        self.length.append(length)
        self.count.append(0)
        self.best_token.append(NO_TOKEN)
        self.best_state.append(-1)
        self.followed.append(0)
        return len(self.length) - 1

    def _clone(self, q: int, length: int) -> int:
        clone = self._new_state(length, self.link[q])
        children = self.next[q]
        self.next[clone] = None if children is None else dict(children)
        self.count[clone] = self.count[q]
        self.best_token[clone] = self.best_token[q]
        self.best_state[clone] = self.best_state[q]
        self.followed[clone] = self.followed[q]
        return clone

    def _redirect(self, p: int, token: int, q: int, clone: int) -> None:
        link = self.link
        while p != -1 and self.child(p, token) == q:
            self._set_child(p, token, clone)
            p = link[p]

    def extend(self, last: int, token: int) -> int:
        """Append ``token`` to the sequence whose cursor is ``last``; returns the new cursor."""
        link, length, child = self.link, self.length, self.child
        q = child(last, token)
        if q >= 0:
            if length[q] == length[last] + 1:
                cur = q
            else:
                cur = self._clone(q, length[last] + 1)
                self._redirect(last, token, q, cur)
                link[q] = cur
        else:
            cur = self._new_state(length[last] + 1, ROOT)
            p = last
            while p != -1 and child(p, token) < 0:
                self._set_child(p, token, cur)
                p = link[p]
            if p != -1:
                q = child(p, token)
                if length[p] + 1 == length[q]:
                    link[cur] = q
                else:
                    clone = self._clone(q, length[p] + 1)
                    self._redirect(p, token, q, clone)
                    link[q] = clone
                    link[cur] = clone
        # The new end position belongs to every suffix of the sequence: the link path of cur.
        count = self.count
        v = cur
        while v > ROOT:
            count[v] += 1
            v = link[v]
        # Every suffix of the sequence before this token (the link path of last) was followed once
        # more, by ``token``: update its tally and, if this continuation now leads, its best.
        nxt, best_token, best_state, followed = self.next, self.best_token, self.best_state, self.followed
        p = last
        while p != -1:
            followed[p] += 1
            children = nxt[p]
            if children is not None:
                target = children[token]
                best = best_state[p]
                if best < 0 or count[target] >= count[best]:
                    best_token[p] = token
                    best_state[p] = target
            p = link[p]
        self.num_tokens += 1
        return cur

    def step(self, state: int, matched: int, token: int) -> tuple[int, int]:
        """Extend a match (state, matched length) by ``token``: the longest suffix that stays known."""
        link, length, child = self.link, self.length, self.child
        target = child(state, token)
        while target < 0 and state != ROOT:
            state = link[state]
            matched = length[state]
            target = child(state, token)
        if target < 0:
            return ROOT, 0
        return target, matched + 1

    def match(self, tokens: list[int]) -> tuple[int, int]:
        state, matched = ROOT, 0
        for token in tokens:
            state, matched = self.step(state, matched, token)
        return state, matched

    def continuations(self, state: int) -> list[tuple[int, int]]:
        """All (token, count) that followed this state, most frequent first; among equal counts the
        state's best continuation (the newest) first, then by token id (cached until it changes)."""
        stamp = self.followed[state]
        cached = self._ranked.get(state)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        count = self.count
        children = self.next[state]
        if children is None:
            token = self.best_token[state]
            return [] if token < 0 else [(token, count[self.best_state[state]])]
        best = self.best_token[state]
        ranked = sorted(((t, count[u]) for t, u in children.items()), key=lambda tc: (-tc[1], tc[0] != best, tc[0]))
        self._ranked[state] = (stamp, ranked)
        return ranked
