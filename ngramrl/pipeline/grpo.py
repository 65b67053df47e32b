"""GRPO's math: group-normalised advantages and the clipped policy-gradient loss (torch only)."""

from __future__ import annotations

from collections import defaultdict

import torch


def group_advantages(rewards: list[float], groups: list[str], eps: float = 1e-6) -> list[float]:
    """Each reward minus its group's mean, over the group's standard deviation (0 for a flat group)."""
    if len(rewards) != len(groups):
        raise ValueError(f"{len(rewards)} rewards for {len(groups)} group labels")
    members: dict[str, list[int]] = defaultdict(list)
    for i, group in enumerate(groups):
        members[group].append(i)
    advantages = [0.0] * len(rewards)
    for indices in members.values():
        values = torch.tensor([rewards[i] for i in indices], dtype=torch.float64)
        std = values.std(unbiased=False) if len(indices) > 1 else torch.tensor(0.0, dtype=torch.float64)
        for i, value in zip(indices, values.tolist(), strict=True):
            advantages[i] = 0.0 if std < eps else (value - values.mean().item()) / (std.item() + eps)
    return advantages


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) at each position; logits [B, T, V] predict targets [B, T]. (Gather minus
    logsumexp: no second vocabulary-sized tensor, which matters for large vocabularies.)"""
    logits = logits.float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip: float, ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate per token, averaged per sequence, then over sequences; plus ``kl_coef``
    times the k3 estimate of KL(policy || reference). Tensors are [B, T]; ``advantages`` is [B]."""
    ratio = torch.exp(logp - old_logp)
    adv = advantages.unsqueeze(-1)
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
    per_token = -surrogate
    kl = torch.zeros_like(logp)
    if ref_logp is not None and kl_coef > 0:
        delta = ref_logp - logp
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + kl_coef * kl
    lengths = mask.sum(-1).clamp(min=1)
    loss = ((per_token * mask).sum(-1) / lengths).mean()
    with torch.no_grad():
        clipped = ((ratio - 1).abs() > clip).float()
        metrics = {"kl": ((kl * mask).sum(-1) / lengths).mean().item(),
                   "clip_fraction": ((clipped * mask).sum() / mask.sum().clamp(min=1)).item()}
    return loss, metrics
