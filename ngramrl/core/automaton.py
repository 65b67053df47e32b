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
                 "num_sequences")

    def __init__(self) -> None:
        self.next: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.count: list[int] = [0]            # occurrences: size of the state's end-position set
        self.best_token: list[int] = [NO_TOKEN]  # most frequent continuation (newest on ties)
        self.best_state: list[int] = [-1]
        self.followed: list[int] = [0]         # occurrences that some token followed
        self.num_tokens = 0
        self.num_sequences = 0

    @property
    def num_states(self) -> int:
        return len(self.length)

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
        self.next.append({})
        self.link.append(link)
        self.length.append(length)
        self.count.append(0)
        self.best_token.append(NO_TOKEN)
        self.best_state.append(-1)
        self.followed.append(0)
        return len(self.length) - 1

    def _clone(self, q: int, length: int) -> int:
        clone = self._new_state(length, self.link[q])
        self.next[clone] = dict(self.next[q])
        self.count[clone] = self.count[q]
        self.best_token[clone] = self.best_token[q]
        self.best_state[clone] = self.best_state[q]
        self.followed[clone] = self.followed[q]
        return clone

    def _redirect(self, p: int, token: int, q: int, clone: int) -> None:
        nxt, link, best_state = self.next, self.link, self.best_state
        while p != -1 and nxt[p].get(token) == q:
            nxt[p][token] = clone
            if best_state[p] == q:
                best_state[p] = clone
            p = link[p]

    def extend(self, last: int, token: int) -> int:
        """Append ``token`` to the sequence whose cursor is ``last``; returns the new cursor."""
        nxt, link, length = self.next, self.link, self.length
        q = nxt[last].get(token)
        if q is not None:
            if length[q] == length[last] + 1:
                cur = q
            else:
                cur = self._clone(q, length[last] + 1)
                self._redirect(last, token, q, cur)
                link[q] = cur
        else:
            cur = self._new_state(length[last] + 1, ROOT)
            p = last
            while p != -1 and token not in nxt[p]:
                nxt[p][token] = cur
                p = link[p]
            if p != -1:
                q = nxt[p][token]
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
        best_token, best_state, followed = self.best_token, self.best_state, self.followed
        p = last
        while p != -1:
            child = nxt[p][token]
            followed[p] += 1
            best = best_state[p]
            if best < 0 or count[child] >= count[best]:
                best_token[p] = token
                best_state[p] = child
            p = link[p]
        self.num_tokens += 1
        return cur

    def step(self, state: int, matched: int, token: int) -> tuple[int, int]:
        """Extend a match (state, matched length) by ``token``: the longest suffix that stays known."""
        nxt, link, length = self.next, self.link, self.length
        while state != ROOT and token not in nxt[state]:
            state = link[state]
            matched = length[state]
        target = nxt[state].get(token)
        if target is None:
            return ROOT, 0
        return target, matched + 1

    def match(self, tokens: list[int]) -> tuple[int, int]:
        state, matched = ROOT, 0
        for token in tokens:
            state, matched = self.step(state, matched, token)
        return state, matched

    def continuations(self, state: int) -> list[tuple[int, int]]:
        """All (token, count) that followed this state, most frequent first."""
        count = self.count
        return sorted(((t, count[u]) for t, u in self.next[state].items()), key=lambda tc: -tc[1])
