"""Exact verification of drafts without draft probabilities: token sequences (chains) and trees.

Speculative sampling with a deterministic draft x_1..x_k keeps the target's distribution exactly:
at position i the draft token is accepted with probability p_i(x_i); on the first rejection the
emitted token is drawn from p_i with x_i removed (renormalised); if all k are accepted a bonus
token is drawn from p_{k+1}. "Accept with p(x), else draw from p without x" has the same law as
"draw y ~ p, accept iff y == x", so each emitted token has exactly the target's distribution.
Greedy rows (temperature 0) use one-hot distributions, which reduces to: accept while the draft
equals the argmax, then emit the argmax.

A draft tree (several continuations sharing prefixes) is verified by letting the target sample its
own token at each node and descending while that token is a child (``verify_tree``): the accepted
length is that of the longest root path the target's tokens follow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingSettings:
    """Per-row sampling settings of a batch; temperature 0 means greedy."""

    temperature: torch.Tensor  # [B] float
    top_k: torch.Tensor        # [B] int; <= 0 or >= vocab disables
    top_p: torch.Tensor        # [B] float in (0, 1]; 1 disables

    @classmethod
    def uniform(cls, batch: int, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0) -> SamplingSettings:
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        return cls(torch.full((batch,), float(temperature)), torch.full((batch,), int(top_k)),
                   torch.full((batch,), float(top_p)))


def target_probs(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """Token distributions [B, T, V] after temperature, top-k and top-p; one-hot for greedy rows."""
    logits = logits.float()
    batch, _, vocab = logits.shape
    greedy = settings.temperature <= 0
    temperature = torch.where(greedy, torch.ones_like(settings.temperature), settings.temperature)
    probs = torch.softmax(logits / temperature.view(batch, 1, 1), dim=-1)
    top_k = settings.top_k.clone()
    top_k[(top_k <= 0) | (top_k > vocab)] = vocab
    needs_filter = (top_k < vocab) | (settings.top_p < 1)
    if bool(needs_filter.any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(vocab).view(1, 1, vocab)
        cumulative_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = (rank >= top_k.view(batch, 1, 1)) | (cumulative_before >= settings.top_p.view(batch, 1, 1))
        drop[..., 0] = False  # the most likely token always stays
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        filtered = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        filtered = filtered / filtered.sum(dim=-1, keepdim=True)
        probs = torch.where(needs_filter.view(batch, 1, 1), filtered, probs)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy.view(batch, 1, 1), one_hot, probs)
    return probs


def sample(logits: torch.Tensor, settings: SamplingSettings, generator: torch.Generator | None = None) -> torch.Tensor:
    """Plain (non-speculative) sampling of one token per row from logits [B, V]."""
    probs = target_probs(logits.unsqueeze(1), settings)[:, 0]
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass
class Verification:
    accepted: torch.Tensor  # [B] number of draft tokens accepted
    emitted: torch.Tensor   # [B] the token the target emits after them (correction or bonus)

    def committed(self, drafts: torch.Tensor) -> list[list[int]]:
        """Per row: the accepted draft tokens followed by the emitted token."""
        out = []
        for row, (n, token) in enumerate(zip(self.accepted.tolist(), self.emitted.tolist(), strict=True)):
            out.append(drafts[row, :n].tolist() + [token])
        return out


def verify(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    draft_lengths: torch.Tensor,
    settings: SamplingSettings,
    generator: torch.Generator | None = None,
) -> Verification:
    """Verify a batch of drafts.

    logits: [B, K+1, V], the target's logits at the positions of draft tokens 1..K and the one after.
    drafts: [B, K] token ids (any value past a row's length); draft_lengths: [B] in 0..K.
    """
    batch, positions, _ = logits.shape
    k = positions - 1
    if drafts.shape != (batch, k):
        raise ValueError(f"drafts must have shape {(batch, k)}, got {tuple(drafts.shape)}")
    probs = target_probs(logits, settings)
    rows = torch.arange(batch)
    if k > 0:
        safe = drafts.clamp(min=0).long()
        p_draft = probs[:, :k].gather(-1, safe.unsqueeze(-1)).squeeze(-1)
        in_draft = torch.arange(k).view(1, k) < draft_lengths.view(batch, 1)
        uniform = torch.rand((batch, k), generator=generator)
        accept = (uniform < p_draft) & in_draft
        accepted = accept.long().cumprod(dim=-1).sum(dim=-1)
    else:
        accepted = torch.zeros(batch, dtype=torch.long)
    dist = probs[rows, accepted].clone()
    rejected = accepted < draft_lengths
    if bool(rejected.any()) and k > 0:
        rejected_token = drafts[rows, accepted.clamp(max=k - 1)].clamp(min=0).long()
        residual = dist.clone()
        residual[rows, rejected_token] = 0.0
        mass = residual.sum(dim=-1, keepdim=True)
        usable = rejected & (mass.squeeze(-1) > 0)
        residual = residual / mass.clamp(min=1e-30)
        dist = torch.where(usable.view(batch, 1), residual, dist)
    emitted = torch.multinomial(dist, 1, generator=generator).squeeze(-1)
    return Verification(accepted, emitted)


@dataclass
class TreeVerification:
    accepted: torch.Tensor  # [B] draft tokens accepted: the length of the accepted root path
    emitted: torch.Tensor   # [B] the token the target emits after them
    nodes: list[list[int]]  # per row, the accepted path's nodes from the root down

    def committed(self, tokens: torch.Tensor) -> list[list[int]]:
        """Per row: the accepted path's tokens followed by the emitted token."""
        return [[int(tokens[row, node]) for node in path] + [int(token)]
                for row, (path, token) in enumerate(zip(self.nodes, self.emitted.tolist(), strict=True))]


def verify_tree(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    sizes: torch.Tensor,
    settings: SamplingSettings,
    generator: torch.Generator | None = None,
) -> TreeVerification:
    """Verify a batch of draft trees (drafts without probabilities).

    Row r's tree has ``sizes[r]`` nodes; node i carries ``tokens[r, i]`` and hangs under
    ``parents[r, i]`` (-1: under the context; a parent always comes before its children).
    logits: [B, N+1, V], position 0 the target's logits for the token after the context and
    position i + 1 those after node i's root path; tokens, parents: [B, N]; sizes: [B] in 0..N.

    From the root, the target samples its own token y at the current node (its processed
    distribution: temperature, top-k, top-p; the argmax for greedy rows); if a child of the node
    carries y the walk descends into it, otherwise y is emitted and the row is done (at a leaf
    every y is emitted: the bonus token). Every token committed is then a draw from the target's
    distribution given the tokens before it, whatever the tree: exact. A chain is the tree whose
    node i hangs under node i - 1."""
    batch, positions, _ = logits.shape
    n = positions - 1
    if tokens.shape != (batch, n) or parents.shape != (batch, n):
        raise ValueError(f"tokens and parents must have shape {(batch, n)}, got {tuple(tokens.shape)} and "
                         f"{tuple(parents.shape)}")
    if bool(((sizes < 0) | (sizes > n)).any()):
        raise ValueError(f"tree sizes must be in 0..{n}, got {sizes.tolist()}")
    in_tree = torch.arange(n).view(1, n) < sizes.view(batch, 1)
    if bool((in_tree & ((parents < -1) | (parents >= torch.arange(n).view(1, n)))).any()):
        raise ValueError("every node's parent must be -1 or an earlier node of its tree")
    probs = target_probs(logits, settings)
    rows = torch.arange(batch)
    current = torch.full((batch,), -1, dtype=torch.long)
    active = torch.ones(batch, dtype=torch.bool)
    emitted = torch.zeros(batch, dtype=torch.long)
    nodes: list[list[int]] = [[] for _ in range(batch)]
    while bool(active.any()):
        y = torch.multinomial(probs[rows, current + 1], 1, generator=generator).squeeze(-1)
        match = in_tree & (parents == current.view(batch, 1)) & (tokens == y.view(batch, 1))
        found = match.any(dim=-1) & active
        child = match.long().argmax(dim=-1)
        for row in found.nonzero().flatten().tolist():
            nodes[row].append(int(child[row]))
        done = active & ~found
        emitted = torch.where(done, y, emitted)
        current = torch.where(found, child, current)
        active = found
    accepted = torch.tensor([len(path) for path in nodes], dtype=torch.long)
    return TreeVerification(accepted, emitted, nodes)
