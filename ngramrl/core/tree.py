"""Draft trees, grown best-first by estimated path probability, and the chain chosen from one.

A draft tree proposes several continuations at once: node i carries a token, its parent (-1: the
node follows the context directly) and the estimated chance that its token follows its parent's
path (``continuation_estimates`` at that path). The chance that verification accepts the whole
root path of a node is the product of those estimates along it, its *path probability*, and the
expected number of accepted tokens is the sum of the path probabilities of all nodes. So growing
the tree by always adding the candidate node of highest path probability makes the expected
accepted length as large as any tree of that many nodes can have it (a child is never likelier
than its parent, so the best n nodes always form a tree), until the limit on root-to-leaf paths
(``width``) stops new branches; after that only leaves are extended. Where the history is certain
this spends the budget on depth, where it is not, on alternatives.

Verifying a tree exactly is simple for drafts without probabilities: at each node the target
samples its own token; if it is a child the walk descends, otherwise that token is emitted
(``ngramrl.core.verifier.verify_tree``). The accepted length is that of the longest matching
root path.

A chain is a tree of width 1. ``choose_path`` takes the root path of largest expected accepted
length from a tree, and ``extend_path`` continues it with the likeliest token at each step.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from ngramrl.core.estimate import Source, continuation_estimates, step_sources

ROOT_NODE = -1  # the parent of the nodes that follow the context directly


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)      # ROOT_NODE or an earlier node
    probs: list[float] = field(default_factory=list)      # chance the token follows its parent's path
    path_probs: list[float] = field(default_factory=list)  # chance its whole root path is accepted
    matched: int = 0  # context tokens matched in the prompt's index

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self, node: int) -> list[int]:
        """The nodes under ``node`` (ROOT_NODE: under the context), in the order they were added."""
        return [i for i, parent in enumerate(self.parents) if parent == node]

    def leaves(self) -> list[int]:
        inner = set(self.parents)
        return [i for i in range(len(self.tokens)) if i not in inner]

    def path(self, node: int) -> list[int]:
        """The nodes from the root down to ``node``."""
        out = []
        while node != ROOT_NODE:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    @property
    def expected_accepted(self) -> float:
        """Expected accepted tokens under the tree's own estimates."""
        return sum(self.path_probs)

    def accept(self, truth: list[int]) -> list[int]:
        """The nodes of the longest root path whose tokens are a prefix of ``truth``."""
        node, accepted = ROOT_NODE, []
        for token in truth:
            node = next((c for c, parent in enumerate(self.parents)
                         if parent == node and self.tokens[c] == token), ROOT_NODE)
            if node == ROOT_NODE:
                break
            accepted.append(node)
        return accepted


Chance = Callable[[int, float], float]  # (depth, estimate) -> the chance the token is accepted there


def grow_tree(sources: list[Source], size: int, width: int, levels: int, min_length: int = 1,
              floor: float = 0.0, stops: Collection[int] = (),
              chance: Chance | None = None) -> tuple[DraftTree, list[list[Source]]]:
    """The best-first tree of at most ``size`` nodes and ``width`` root-to-leaf paths from the
    context whose match states are ``sources``; also each node's match states.

    Candidates are the ``width`` likeliest continuations of the context and of every added node
    (a node added once the tree has ``width`` leaves only its likeliest: no further branch can be
    added then). The candidate of highest path probability is added next, ties going to the one
    proposed first; a candidate that would open a path beyond ``width`` is dropped. Growth stops
    at ``size`` nodes, when no candidate is left, or when the best one's path probability is
    below ``floor``. A node whose token is in ``stops`` (end of sequence) gets no children.
    ``chance``: path probabilities multiply the chance each estimate is accepted at its depth
    (``AcceptanceCalibration.chance``: what verification showed of such estimates) instead of the
    estimate itself; the nodes keep their estimates in ``probs``."""
    tree = DraftTree()
    node_sources: list[list[Source]] = []
    if size <= 0 or width <= 0:
        return tree, node_sources
    heap: list[tuple[float, int, int, int, float]] = []  # (-path probability, order, parent, token, prob)
    proposed = 0
    depths: list[int] = []

    def propose(parent: int, depth: int, at: list[Source], path_prob: float, limit: int) -> None:
        nonlocal proposed
        for p, token in continuation_estimates(at, levels, limit, min_length=min_length):
            heapq.heappush(heap, (-path_prob * (p if chance is None else chance(depth, p)), proposed, parent, token, p))
            proposed += 1

    propose(ROOT_NODE, 0, sources, 1.0, width)
    has_children: list[bool] = []
    root_has_children = False
    leaves = 0
    while heap and len(tree.tokens) < size:
        negative, _, parent, token, p = heapq.heappop(heap)
        path_prob = -negative
        if path_prob < floor:
            break
        branches = root_has_children if parent == ROOT_NODE else has_children[parent]
        if branches or parent == ROOT_NODE:  # a new root-to-leaf path
            if leaves >= width:
                continue
            leaves += 1
        if parent == ROOT_NODE:
            root_has_children = True
        else:
            has_children[parent] = True
        node = len(tree.tokens)
        tree.tokens.append(token)
        tree.parents.append(parent)
        tree.probs.append(p)
        tree.path_probs.append(path_prob)
        depths.append(0 if parent == ROOT_NODE else depths[parent] + 1)
        has_children.append(False)
        at = step_sources(sources if parent == ROOT_NODE else node_sources[parent], token)
        node_sources.append(at)
        if token not in stops and len(tree.tokens) < size:
            propose(node, depths[node] + 1, at, path_prob, width if leaves < width else 1)
    return tree, node_sources


def choose_path(tree: DraftTree) -> list[int]:
    """The root path of the largest expected accepted length (the sum of its nodes' path
    probabilities), ties going to the leaf added first; [] for an empty tree."""
    best: list[int] = []
    best_value = -1.0
    for leaf in tree.leaves():
        path = tree.path(leaf)
        value = sum(tree.path_probs[i] for i in path)
        if value > best_value:
            best, best_value = path, value
    return best


def extend_path(at: list[Source], path_prob: float, room: int, levels: int, min_length: int = 1,
                floor: float = 0.0, stops: Collection[int] = ()) -> tuple[list[int], list[float]]:
    """Up to ``room`` more tokens after a path whose match states are ``at``: the likeliest
    continuation each time, until a stop token, no evidence, or a path probability below
    ``floor``. Returns the tokens and their estimates."""
    tokens: list[int] = []
    probs: list[float] = []
    while len(tokens) < room:
        estimates = continuation_estimates(at, levels, 1, min_length=min_length)
        if not estimates:
            break
        p, token = estimates[0]
        path_prob *= p
        if path_prob < floor:
            break
        tokens.append(token)
        probs.append(p)
        if token in stops or len(tokens) >= room:
            break
        at = step_sources(at, token)
    return tokens, probs


def path_chain(sources: list[Source], k: int, width: int, levels: int, min_length: int = 1, floor: float = 0.0,
               stops: Collection[int] = (), chance: Chance | None = None) -> tuple[list[int], list[float]]:
    """The chain of at most ``k`` tokens chosen by expected accepted length: the best root path
    (``choose_path``) of the tree of ``k`` nodes and ``width`` paths (``grow_tree``, ``chance`` as
    there), continued with the likeliest token at each step (``extend_path``, not after a stop
    token). Returns the tokens and their estimates."""
    tree, node_sources = grow_tree(sources, k, width, levels, min_length, floor, stops, chance)
    path = choose_path(tree)
    if not path:
        return [], []
    tokens = [tree.tokens[i] for i in path]
    probs = [tree.probs[i] for i in path]
    if len(tokens) < k and tokens[-1] not in stops:
        more, more_probs = extend_path(node_sources[path[-1]], tree.path_probs[path[-1]], k - len(tokens), levels,
                                       min_length, floor, stops)
        tokens += more
        probs += more_probs
    return tokens, probs


__all__ = ["DraftTree", "ROOT_NODE", "choose_path", "extend_path", "grow_tree", "path_chain"]
