"""The measured step profile: the timed decoder computes what the Hugging Face model computes, and
a CPU measurement of a tiny shape gives a complete, valid profile."""

import pytest

from ngramrl.bench.gpu_profile import (
    ATTENTION_KINDS,
    Decoder,
    MeasureConfig,
    choose_attention,
    fill_missing,
    measure_profile,
)
from ngramrl.core.profile import MODEL_SHAPES, ModelShape, StepProfile

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def hf_model(kind):
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=64)
    if kind == "qwen3":
        config = transformers.Qwen3Config(head_dim=16, tie_word_embeddings=False, **common)
        return transformers.Qwen3ForCausalLM(config)
    if kind == "qwen2":
        config = transformers.Qwen2Config(tie_word_embeddings=True, **common)
        return transformers.Qwen2ForCausalLM(config)
    config = transformers.LlamaConfig(tie_word_embeddings=False, **common)
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("attention", ATTENTION_KINDS)
@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama"])
def test_decoder_steps_give_the_hf_models_logits(kind, attention):
    torch.manual_seed(0)
    model = hf_model(kind).eval()
    for parameter in model.parameters():  # norms and biases away from their defaults, so they matter
        parameter.data.add_(0.05 * torch.randn_like(parameter))
    shape = ModelShape.from_hf_config(model.config.to_dict(), kind)
    assert shape.qk_norm == (kind == "qwen3") and shape.qkv_bias == (kind == "qwen2")
    decoder = Decoder.from_hf_state(shape, model.state_dict(), torch.device("cpu"), torch.float32)
    decoder.attention = attention
    ids = torch.randint(0, 97, (2, 9))
    cache = decoder.new_cache(2, 9)
    context = 6
    decoder.forward(ids[:, :context], cache, 0, *decoder.rotary(0, context), decoder.attention_mask(0, context))
    logits = decoder.forward(ids[:, context:], cache, context, *decoder.rotary(context, 3),
                             decoder.attention_mask(context, 3))
    with torch.no_grad():
        expected = model(ids).logits[:, context:]
    assert torch.allclose(logits, expected, atol=1e-4, rtol=1e-4)


def test_the_faster_attention_that_computes_the_same_logits_is_chosen_and_both_are_reported():
    decoder = Decoder(MODEL_SHAPES["tiny"], torch.device("cpu"), torch.float32)
    chosen, tried = choose_attention(decoder, graphs=False, tokens=4, context=32, batch=2, target_s=0.0)
    assert decoder.attention == chosen and set(tried) == set(ATTENTION_KINDS)
    assert all(isinstance(ms, float) and ms > 0 for ms in tried.values())
    assert tried[chosen] == min(tried.values())


def test_a_tiny_shape_measured_on_the_cpu_is_a_complete_profile():
    config = MeasureConfig(device="cpu", k=3, batches=(1, 4), tokens=(1, 2, 4), contexts=(16, 64), target_s=0.0)
    profile = measure_profile(MODEL_SHAPES["tiny"], config)
    assert profile.source == "measured" and profile.batches == [1, 4] and profile.tokens == [1, 2, 4]
    assert all(v for row in profile.measured for cell in row for v in cell)
    assert all(v > 0 for row in profile.step_ms for cell in row for v in cell)
    assert profile.prefill_ms_per_token > 0
    assert profile.device["attention"] in ATTENTION_KINDS
    again = StepProfile.from_json(profile.to_json())
    flat = [v for row in profile.step_ms for cell in row for v in cell]
    assert [v for row in again.step_ms for cell in row for v in cell] == pytest.approx(flat, rel=1e-4)


def test_shapes_not_measured_are_extrapolated_from_their_neighbours():
    # step = 1 + batch * (0.1 + 0.01 * context) * tokens: linear along every axis
    batches, tokens, contexts = (1, 2, 4), (1, 3), (10, 20, 40)

    def truth(b, t, c):
        return 1 + b * (0.1 + 0.01 * c) * t

    table = [[[truth(b, t, c) for c in contexts] for t in tokens] for b in batches]
    table[2][1][2] = table[2][0][2] = table[1][1][2] = None  # the largest batch x context did not fit
    filled = fill_missing(table, batches, tokens, contexts)
    for b, batch in enumerate(batches):
        for t, count in enumerate(tokens):
            for c, context in enumerate(contexts):
                assert filled[b][t][c] == pytest.approx(truth(batch, count, context))
