"""Exactness of speculative verification against plain decoding, on a toy second-order Markov target."""

import itertools

import pytest
import torch
from scipy.stats import chisquare

from ngramrl.core import verifier
from ngramrl.core.verifier import SamplingSettings, sample, target_probs, verify

VOCAB = 5
LENGTH = 3
DRAFT_K = 2


def make_tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    target = torch.randn((VOCAB, VOCAB, VOCAB), generator=g) * 1.5
    drafter = torch.randn((VOCAB, VOCAB, VOCAB), generator=g) * 1.5
    return target, drafter


def logits_for(table: torch.Tensor, seqs: torch.Tensor) -> torch.Tensor:
    return table[seqs[:, -2], seqs[:, -1]]


def plain_decode(table, settings, rows, generator):
    seqs = torch.zeros((rows, 2), dtype=torch.long)
    for _ in range(LENGTH):
        token = sample(logits_for(table, seqs), settings, generator)
        seqs = torch.cat([seqs, token.unsqueeze(1)], dim=1)
    return seqs[:, 2:]


def speculative_decode(table, draft_table, settings, rows, generator, draft_lengths=None, verify_fn=verify):
    """Each row keeps its own committed tokens; drafts are the draft table's argmax chain."""
    out = [[0, 0] for _ in range(rows)]
    while min(len(o) for o in out) < 2 + LENGTH:
        ctx = torch.tensor([o[-2:] for o in out])
        drafts = []
        seqs = ctx
        for _ in range(DRAFT_K):
            nxt = logits_for(draft_table, seqs).argmax(-1)
            drafts.append(nxt)
            seqs = torch.cat([seqs, nxt.unsqueeze(1)], dim=1)
        drafts = torch.stack(drafts, dim=1)
        logits = torch.stack([logits_for(table, seqs[:, : 2 + i]) for i in range(DRAFT_K + 1)], dim=1)
        lengths = draft_lengths if draft_lengths is not None else torch.full((rows,), DRAFT_K)
        result = verify_fn(logits, drafts, lengths, settings, generator)
        for row, tokens in enumerate(result.committed(drafts)):
            out[row].extend(tokens)
    return torch.tensor([o[2 : 2 + LENGTH] for o in out])


def exact_distribution(table, settings_row):
    """Probability of every length-3 output under plain decoding, by enumeration."""
    probs = {}
    for seq in itertools.product(range(VOCAB), repeat=LENGTH):
        ctx = [0, 0]
        p = 1.0
        for token in seq:
            dist = target_probs(table[ctx[-2], ctx[-1]].view(1, 1, VOCAB), settings_row)[0, 0]
            p *= float(dist[token])
            ctx.append(token)
        probs[seq] = p
    return probs


def chi_square_pvalue(samples: torch.Tensor, expected: dict) -> float:
    counts = {key: 0 for key in expected}
    for row in samples.tolist():
        counts[tuple(row)] += 1
    keys = [key for key, p in expected.items() if p > 0]
    observed = [counts[key] for key in keys]
    assert sum(counts[key] for key, p in expected.items() if p == 0) == 0, "emitted a token with zero probability"
    total = len(samples)
    exp = [expected[key] * total for key in keys]
    scale = sum(observed) / sum(exp)
    return chisquare(observed, [e * scale for e in exp]).pvalue


SETTINGS = [
    dict(temperature=1.0, top_k=-1, top_p=1.0),
    dict(temperature=0.7, top_k=3, top_p=1.0),
    dict(temperature=1.3, top_k=-1, top_p=0.8),
    dict(temperature=0.9, top_k=4, top_p=0.9),
]


@pytest.mark.parametrize("params", SETTINGS)
def test_sampled_outputs_match_plain_sampling_distribution(params):
    table, draft_table = make_tables(1)
    rows = 20000
    settings = SamplingSettings.uniform(rows, **params)
    generator = torch.Generator().manual_seed(7)
    spec = speculative_decode(table, draft_table, settings, rows, generator)
    expected = exact_distribution(table, SamplingSettings.uniform(1, **params))
    assert chi_square_pvalue(spec, expected) > 1e-4
    plain = plain_decode(table, settings, rows, generator)
    assert chi_square_pvalue(plain, expected) > 1e-4  # the reference sampler agrees with enumeration too


def test_mixed_batch_greedy_rows_stay_exact_and_sampled_rows_keep_distribution():
    table, draft_table = make_tables(2)
    rows = 12000
    temperature = torch.where(torch.arange(rows) % 3 == 0, 0.0, 1.0)
    settings = SamplingSettings(temperature, torch.full((rows,), -1), torch.full((rows,), 1.0))
    spec = speculative_decode(table, draft_table, settings, rows, torch.Generator().manual_seed(3))
    greedy_rows = spec[temperature == 0]
    greedy_ref = plain_decode(table, SamplingSettings.uniform(1, temperature=0.0), 1, None)
    assert bool((greedy_rows == greedy_ref).all())
    expected = exact_distribution(table, SamplingSettings.uniform(1, temperature=1.0))
    assert chi_square_pvalue(spec[temperature > 0], expected) > 1e-4


def test_greedy_is_identical_to_plain_greedy_decoding_for_many_tables():
    for seed in range(20):
        table, draft_table = make_tables(seed)
        settings = SamplingSettings.uniform(4, temperature=0.0)
        spec = speculative_decode(table, draft_table, settings, 4, torch.Generator().manual_seed(seed))
        plain = plain_decode(table, settings, 4, None)
        assert torch.equal(spec, plain)


def test_variable_draft_lengths_including_empty():
    table, draft_table = make_tables(4)
    rows = 20000
    settings = SamplingSettings.uniform(rows, temperature=1.0)
    lengths = torch.arange(rows) % (DRAFT_K + 1)
    spec = speculative_decode(table, draft_table, settings, rows, torch.Generator().manual_seed(5), lengths)
    expected = exact_distribution(table, SamplingSettings.uniform(1, temperature=1.0))
    assert chi_square_pvalue(spec, expected) > 1e-4


def test_planted_bug_skipping_residual_resampling_is_detected():
    """Drawing the correction from p instead of p without the rejected token must fail the test."""
    def buggy_verify(logits, drafts, draft_lengths, settings, generator=None):
        probs = target_probs(logits, settings)
        batch, positions, _ = logits.shape
        k = positions - 1
        safe = drafts.clamp(min=0).long()
        p_draft = probs[:, :k].gather(-1, safe.unsqueeze(-1)).squeeze(-1)
        in_draft = torch.arange(k).view(1, k) < draft_lengths.view(batch, 1)
        accept = (torch.rand((batch, k), generator=generator) < p_draft) & in_draft
        accepted = accept.long().cumprod(dim=-1).sum(dim=-1)
        dist = probs[torch.arange(batch), accepted]
        emitted = torch.multinomial(dist, 1, generator=generator).squeeze(-1)
        return verifier.Verification(accepted, emitted)

    table, draft_table = make_tables(1)
    rows = 20000
    settings = SamplingSettings.uniform(rows, temperature=1.0)
    generator = torch.Generator().manual_seed(7)
    spec = speculative_decode(table, draft_table, settings, rows, generator, verify_fn=buggy_verify)
    expected = exact_distribution(table, SamplingSettings.uniform(1, temperature=1.0))
    assert chi_square_pvalue(spec, expected) < 1e-6


def test_top_k_and_top_p_filtering():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]]))
    p = target_probs(logits, SamplingSettings.uniform(1, top_k=2))[0, 0]
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    p = target_probs(logits, SamplingSettings.uniform(1, top_p=0.8))[0, 0]
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    p = target_probs(logits, SamplingSettings.uniform(1, top_p=0.81))[0, 0]
    assert torch.allclose(p, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    with pytest.raises(ValueError):
        SamplingSettings.uniform(1, temperature=-1)
