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


# -- draft trees ------------------------------------------------------------------------------

TREE_PARENTS = [-1, -1, 0, 1, 2]  # two first tokens, each continued; the likelier one twice


def tree_drafts(draft_table, ctx):
    """Per row: the draft table's two likeliest first tokens, each continued by its argmax, the
    first path once more; returns tokens [B, 5] and each node's context (the tokens before it)."""
    rows = ctx.shape[0]
    first = logits_for(draft_table, ctx).topk(2, dim=-1).indices
    tokens = torch.zeros((rows, len(TREE_PARENTS)), dtype=torch.long)
    paths = {-1: ctx}
    for node, parent in enumerate(TREE_PARENTS):
        before = paths[parent]
        tokens[:, node] = first[:, node] if parent == -1 else logits_for(draft_table, before).argmax(-1)
        paths[node] = torch.cat([before, tokens[:, node:node + 1]], dim=1)
    return tokens, paths


def tree_speculative_decode(table, draft_table, settings, rows, generator, sizes=None, verify_fn=None):
    verify_fn = verify_fn or verifier.verify_tree
    out = [[0, 0] for _ in range(rows)]
    n = len(TREE_PARENTS)
    parents = torch.tensor(TREE_PARENTS).expand(rows, n)
    sizes = sizes if sizes is not None else torch.full((rows,), n)
    while min(len(o) for o in out) < 2 + LENGTH:
        ctx = torch.tensor([o[-2:] for o in out])
        tokens, paths = tree_drafts(draft_table, ctx)
        logits = torch.stack([logits_for(table, paths[node]) for node in range(-1, n)], dim=1)
        result = verify_fn(logits, tokens, parents, sizes, settings, generator)
        for row, committed in enumerate(result.committed(tokens)):
            out[row].extend(committed)
    return torch.tensor([o[2:2 + LENGTH] for o in out])


@pytest.mark.parametrize("params", SETTINGS)
def test_tree_outputs_match_plain_sampling_distribution(params):
    table, draft_table = make_tables(1)
    rows = 20000
    settings = SamplingSettings.uniform(rows, **params)
    spec = tree_speculative_decode(table, draft_table, settings, rows, torch.Generator().manual_seed(11))
    expected = exact_distribution(table, SamplingSettings.uniform(1, **params))
    assert chi_square_pvalue(spec, expected) > 1e-4


def test_tree_greedy_is_identical_to_plain_greedy_decoding_and_accepts_along_a_branch():
    accepted_somewhere = 0
    for seed in range(20):
        table, draft_table = make_tables(seed)
        settings = SamplingSettings.uniform(4, temperature=0.0)
        spec = tree_speculative_decode(table, draft_table, settings, 4, torch.Generator().manual_seed(seed))
        assert torch.equal(spec, plain_decode(table, settings, 4, None))
        ctx = torch.zeros((1, 2), dtype=torch.long)
        tokens, paths = tree_drafts(draft_table, ctx)
        logits = torch.stack([logits_for(table, paths[node]) for node in range(-1, len(TREE_PARENTS))], dim=1)
        result = verifier.verify_tree(logits, tokens, torch.tensor([TREE_PARENTS]), torch.tensor([5]),
                                      SamplingSettings.uniform(1, temperature=0.0))
        path = result.nodes[0]
        for depth, node in enumerate(path):  # each accepted node is the argmax after its parent's path
            before = -1 if depth == 0 else path[depth - 1]
            assert int(tokens[0, node]) == int(logits[0, before + 1].argmax())
        assert int(result.emitted[0]) == int(logits[0, (path[-1] if path else -1) + 1].argmax())
        accepted_somewhere += len(path) > 0
    assert accepted_somewhere > 0


def test_tree_with_variable_sizes_and_mixed_greedy_rows():
    table, draft_table = make_tables(4)
    rows = 20000
    temperature = torch.where(torch.arange(rows) % 4 == 0, 0.0, 1.0)
    settings = SamplingSettings(temperature, torch.full((rows,), -1), torch.full((rows,), 1.0))
    sizes = torch.arange(rows) % (len(TREE_PARENTS) + 1)
    spec = tree_speculative_decode(table, draft_table, settings, rows, torch.Generator().manual_seed(5), sizes)
    assert bool((spec[temperature == 0] == plain_decode(table, SamplingSettings.uniform(1, temperature=0.0),
                                                        1, None)).all())
    expected = exact_distribution(table, SamplingSettings.uniform(1, temperature=1.0))
    assert chi_square_pvalue(spec[temperature > 0], expected) > 1e-4


def test_tree_that_is_a_chain_verifies_like_the_chain_verifier():
    table, draft_table = make_tables(2)
    rows = 20000
    settings = SamplingSettings.uniform(rows, temperature=0.9, top_k=4)
    ctx = torch.zeros((rows, 2), dtype=torch.long)
    drafts = []
    seqs = ctx
    for _ in range(DRAFT_K):
        drafts.append(logits_for(draft_table, seqs).argmax(-1))
        seqs = torch.cat([seqs, drafts[-1].unsqueeze(1)], dim=1)
    drafts = torch.stack(drafts, dim=1)
    logits = torch.stack([logits_for(table, seqs[:, :2 + i]) for i in range(DRAFT_K + 1)], dim=1)
    chain = verify(logits, drafts, torch.full((rows,), DRAFT_K), settings, torch.Generator().manual_seed(1))
    tree = verifier.verify_tree(logits, drafts, torch.arange(-1, DRAFT_K - 1).expand(rows, DRAFT_K),
                                torch.full((rows,), DRAFT_K), settings, torch.Generator().manual_seed(2))
    for n in range(DRAFT_K + 1):  # the law of the accepted length is the same
        a, b = float((chain.accepted == n).float().mean()), float((tree.accepted == n).float().mean())
        assert abs(a - b) < 0.02, (n, a, b)


def test_planted_bug_trying_children_without_renormalising_is_detected():
    """Trying each child in turn with its probability under p (instead of under p without the
    children already rejected) favours the first child: the tree test must fail on it."""
    def buggy_verify_tree(logits, tokens, parents, sizes, settings, generator=None):
        probs = target_probs(logits, settings)
        batch = logits.shape[0]
        nodes, emitted = [], []
        for row in range(batch):
            current, path = -1, []
            while True:
                dist = probs[row, current + 1]
                children = [i for i in range(int(sizes[row])) if int(parents[row, i]) == current]
                taken = None
                for child in children:
                    if float(torch.rand((), generator=generator)) < float(dist[tokens[row, child]]):
                        taken = child
                        break
                if taken is None:
                    residual = dist.clone()
                    residual[tokens[row, children].long()] = 0.0
                    residual = residual / residual.sum() if float(residual.sum()) > 0 else dist
                    emitted.append(int(torch.multinomial(residual, 1, generator=generator)))
                    break
                path.append(taken)
                current = taken
            nodes.append(path)
        return verifier.TreeVerification(torch.tensor([len(p) for p in nodes]), torch.tensor(emitted), nodes)

    table, draft_table = make_tables(1)
    rows = 6000
    settings = SamplingSettings.uniform(rows, temperature=1.0)
    spec = tree_speculative_decode(table, draft_table, settings, rows, torch.Generator().manual_seed(7),
                                   verify_fn=buggy_verify_tree)
    expected = exact_distribution(table, SamplingSettings.uniform(1, temperature=1.0))
    assert chi_square_pvalue(spec, expected) < 1e-6


def test_tree_verifier_rejects_a_malformed_tree():
    logits = torch.zeros((1, 3, VOCAB))
    settings = SamplingSettings.uniform(1)
    with pytest.raises(ValueError, match="earlier node"):
        verifier.verify_tree(logits, torch.tensor([[1, 2]]), torch.tensor([[-1, 1]]), torch.tensor([2]), settings)
    with pytest.raises(ValueError, match="shape"):
        verifier.verify_tree(logits, torch.tensor([[1]]), torch.tensor([[-1]]), torch.tensor([1]), settings)
