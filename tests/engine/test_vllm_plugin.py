"""The plugin's recovered-token sampler (``sample_without``), checked against the residual distribution
it must draw from, and the rows sampled in steps without drafts (``bonus_logits``). (The real engine's
sampled distributions are checked in test_vllm.py.)"""

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from ngramrl.engine.vllm_plugin import bonus_logits, sample_recovered_tokens_cpu, sample_without  # noqa: E402


def residual(probs, excluded):
    out = probs.clone().double()
    out[torch.arange(len(excluded)), excluded] = 0.0
    return out / out.sum(1, keepdim=True)


@pytest.mark.parametrize("vocab, block", [(600, 256), (512, 256), (40, 256), (1000, 7)])
def test_inverting_at_a_uniform_grid_gives_the_residual_distribution(vocab, block):
    """A grid of M evenly spaced uniforms through an exact inverse CDF lands on each token within
    one or two of M times its residual probability: the drawn distribution is the residual one,
    whole blocks, a partial last block and a vocabulary smaller than one block alike."""
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, vocab, generator=generator) * 2
    logits[:, ::5] = float("-inf")  # tokens the target gives no mass (top-k / top-p masks)
    probs = logits.softmax(-1)
    excluded = probs.argmax(-1)  # the likeliest token is the draft: most mass to take out
    excluded[2] = 3  # a draft token with no mass at all
    expected = residual(probs, excluded)
    grid = 20000
    for row in range(3):
        uniform = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid
        tokens = sample_without(probs[row].expand(grid, vocab).contiguous(), excluded[row].repeat(grid), uniform,
                                block=block)
        counts = torch.bincount(tokens, minlength=vocab).double()
        assert counts[excluded[row]] == 0
        assert torch.all(counts[expected[row] == 0] == 0)
        assert torch.max(torch.abs(counts - grid * expected[row])) <= 2.0


def test_the_probabilities_are_restored_and_a_residual_without_mass_gives_the_draft():
    probs = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 0.5, 0.5]])
    before = probs.clone()
    tokens = sample_without(probs, torch.tensor([1, 0, 3]), torch.tensor([0.999, 0.0, 0.0], dtype=torch.float64),
                            block=2)
    assert torch.equal(probs, before)
    # row 0: all mass on the draft; rows 1 and 2: the first token left with mass (past an empty block)
    assert tokens.tolist() == [1, 1, 2]


def test_seeded_requests_draw_from_their_own_generator():
    """A seeded request's recovered tokens depend on its seed alone, not on the other requests
    of the batch nor on the global generator."""
    vocab = 300
    probs = torch.randn(5, vocab, generator=torch.Generator().manual_seed(1)).softmax(-1)
    drafts = torch.tensor([4, 5, 6, 7, 8])

    def recovered(num_draft_tokens, seeds):
        cu = torch.tensor(num_draft_tokens).cumsum(0)
        generators = {i: torch.Generator().manual_seed(s) for i, s in seeds.items()}
        metadata = SimpleNamespace(generators=generators)
        return sample_recovered_tokens_cpu(4, num_draft_tokens, cu, drafts[:int(cu[-1])], None,
                                            probs[:int(cu[-1])].clone(), metadata, "cpu").tolist()

    torch.manual_seed(0)
    first = recovered([2, 3], {1: 77})
    torch.manual_seed(1)
    second = recovered([2, 3], {1: 77})
    assert first[2:] == second[2:]
    other_seed = [recovered([2, 3], {1: seed})[2:] for seed in range(78, 88)]
    assert any(tokens != first[2:] for tokens in other_seed)
    assert all(token != draft for token, draft in zip(first, drafts.tolist(), strict=False))


def test_steps_without_drafts_sample_the_logits_themselves():
    """Every row a bonus row: the sampler gets the logits tensor, not a copy of it; a subset of
    rows (a step with drafts never comes here, but the helper must still be right) is gathered."""
    logits = torch.randn(5, 11)
    assert bonus_logits(logits, torch.arange(5)) is logits
    subset = torch.tensor([1, 4])
    assert torch.equal(bonus_logits(logits, subset), logits[subset])
