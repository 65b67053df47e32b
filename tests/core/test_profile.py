"""Step profiles: the roofline is physical, the table interpolates, and bad profiles are refused."""

import json

import pytest

from ngramrl.core.profile import (
    GPU_SPECS,
    MODEL_SHAPES,
    HostOverhead,
    ModelShape,
    StepProfile,
    load_profile,
    model_shape,
    roofline_profile,
    weight_read_seconds,
    write_profile,
)


def test_qwen3_8b_shape_has_its_published_size():
    shape = MODEL_SHAPES["qwen3-8b"]
    assert shape.params == pytest.approx(8.19e9, rel=0.01)  # Qwen3-8B: 8.2B parameters
    assert shape.kv_bytes_per_token == 2 * 36 * 8 * 128 * 2


@pytest.mark.parametrize("gpu", sorted(GPU_SPECS))
def test_no_roofline_step_is_faster_than_reading_the_weights_once(gpu):
    shape = MODEL_SHAPES["qwen3-8b"]
    profile = roofline_profile(gpu, shape)
    floor = weight_read_seconds(shape, GPU_SPECS[gpu]) * 1000
    assert profile.floor_ms == pytest.approx(floor)
    assert min(v for row in profile.step_ms for cell in row for v in cell) >= floor
    if gpu == "h100":
        assert 5.0 <= profile.forward_seconds(1, 1, 256) * 1000 <= 6.5  # "about 5 ms or more"


def test_roofline_is_flat_while_memory_bound_and_grows_with_tokens_once_compute_bound():
    profile = roofline_profile("h100", MODEL_SHAPES["qwen3-8b"])
    one = profile.forward_seconds(1, 1, 1024)
    assert profile.forward_seconds(1, 9, 1024) == pytest.approx(one, rel=0.01)  # drafts nearly free at batch 1
    big = profile.forward_seconds(512, 512, 1024)
    assert profile.forward_seconds(512, 512 * 9, 1024) > 2.5 * big  # and dear at batch 512
    assert profile.forward_seconds(32, 32, 4096) > profile.forward_seconds(32, 32, 256)  # the KV cache is read


def test_the_table_interpolates_linearly_and_extrapolates_upwards():
    table = [[[1.0 + b + 0.5 * t + 0.01 * c for c in (100, 300)] for t in (1, 3)] for b in (1, 5)]
    profile = StepProfile(source="measured", model={"name": "m"}, device={"name": "d"}, k=2, batches=[1, 5],
                          tokens=[1, 3], contexts=[100, 300], step_ms=table)
    assert profile.forward_seconds(5, 15, 300) * 1000 == pytest.approx(1 + 5 + 1.5 + 3)
    assert profile.forward_seconds(3, 6, 200) * 1000 == pytest.approx(1 + 3 + 1.0 + 2)
    assert profile.forward_seconds(9, 9, 100) * 1000 == pytest.approx(1 + 9 + 0.5 + 1)  # past the last batch
    assert profile.forward_seconds(2, 2, 100, prefill_tokens=50) == profile.forward_seconds(2, 2, 100)  # no cost set


def test_a_profile_survives_json_and_keeps_its_host_overhead(tmp_path):
    profile = roofline_profile("a100", MODEL_SHAPES["llama-3.1-8b"], host=HostOverhead(0.5, 0.004))
    path = tmp_path / "p.json"
    write_profile(profile, str(path))
    again = load_profile(str(path))
    assert again.host == HostOverhead(0.5, 0.004)
    assert again.forward_seconds(64, 200, 777) == pytest.approx(profile.forward_seconds(64, 200, 777), rel=1e-4)
    data = json.loads(path.read_text())
    assert data["ngramrl_step_profile"] == 1 and data["source"] == "roofline"
    form = {(row["batch"], row["context"]): row for row in data["cost_form"]}
    assert form[(32, 1024)]["free_draft_tokens"] > 0  # memory-bound at 32: some draft tokens come free
    assert form[(1024, 1024)]["free_draft_tokens"] == 0 and form[(1024, 1024)]["per_draft_token_us"] > 10


def test_a_profile_missing_a_grid_entry_is_refused_with_where(tmp_path):
    data = roofline_profile("h100", MODEL_SHAPES["qwen3-1.7b"]).to_json()
    data["steps"] = data["steps"][1:]
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"broken\.json: no step time for \(batch, tokens per request, context\)"):
        load_profile(str(path))
    path.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="not an ngramrl step profile"):
        load_profile(str(path))


def test_a_hugging_face_config_gives_the_models_shape(tmp_path):
    config = {"model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
              "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936,
              "tie_word_embeddings": False, "rope_theta": 1000000, "rms_norm_eps": 1e-6}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = model_shape(str(tmp_path))
    named = MODEL_SHAPES["qwen3-8b"]
    assert (shape.params, shape.kv_bytes_per_token, shape.qk_norm) == (named.params, named.kv_bytes_per_token, True)
    with pytest.raises(ValueError, match="neither a known shape"):
        model_shape("gpt-17")
    with pytest.raises(ValueError, match="heads"):
        ModelShape("bad", layers=1, hidden=8, heads=3, kv_heads=2, head_dim=4, intermediate=8, vocab=8)


def profile_json():
    return roofline_profile("h100", MODEL_SHAPES["tiny"], k=2).to_json()


@pytest.mark.parametrize("change, message", [
    ({"model": "x"}, "model must be a JSON object, got 'x'"),
    ({"device": []}, "device must be a JSON object, got []"),
    ({"floor_ms": "abc"}, "floor_ms must be a number > 0 or null, got 'abc'"),
    ({"floor_ms": float("nan")}, "floor_ms must be a number > 0 or null, got nan"),
    ({"k": "8"}, "k must be an integer >= 1, got '8'"),
    ({"prefill_ms_per_token": -1}, "prefill_ms_per_token must be a number >= 0, got -1"),
    ({"host": {"base_ms": "fast"}}, "host.base_ms must be a number >= 0, got 'fast'"),
    ({"host": {"base_mz": 1}}, "host must be a JSON object of base_ms and per_request_ms"),
    ({"notes": "one"}, "notes must be a list of strings, got 'one'"),
    ({"grid": {"batch": [1, 2], "tokens_per_request": "1", "context": [256]}},
     "grid.tokens_per_request must be a list of integers, got '1'"),
    ({"steps": {"batch": 1}}, "steps must be a list"),
    ({"source": "guessed"}, "profile source must be roofline, measured or engine, got 'guessed'"),
])
def test_a_profile_field_of_the_wrong_type_is_refused_naming_file_and_field(tmp_path, change, message):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**profile_json(), **change}))
    with pytest.raises(ValueError) as err:
        load_profile(str(path))
    assert str(err.value).startswith(f"{path}: {message}")


@pytest.mark.parametrize("field, value, message", [
    ("batch", 5, "steps[0].batch 5 is not in grid.batch [1, 2, 4,"),
    ("context", "256", "steps[0].context '256' is not in grid.context [256, 1024, 4096]"),
    ("ms", -1.0, "steps[0].ms must be a number > 0, got -1.0"),
    ("measured", "yes", "steps[0].measured must be true or false, got 'yes'"),
])
def test_a_step_outside_the_grid_or_of_the_wrong_type_is_refused_naming_it(tmp_path, field, value, message):
    data = profile_json()
    data["steps"][0][field] = value
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError) as err:
        load_profile(str(path))
    assert str(err.value).startswith(f"{path}: {message}")


def test_a_profile_that_cannot_be_read_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match=f"^{tmp_path}: cannot read file"):
        load_profile(str(tmp_path))
    binary = tmp_path / "p.json"
    binary.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match=f"^{binary}: cannot read file \\(not UTF-8"):
        load_profile(str(binary))


TINY_CONFIG = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 512}


@pytest.mark.parametrize("config, message", [
    ([TINY_CONFIG], "not a model configuration (a JSON object), got list"),
    ({**TINY_CONFIG, "num_attention_heads": 0, "head_dim": None}, "num_attention_heads must be an integer >= 1, got 0"),
    ({**TINY_CONFIG, "hidden_size": "64"}, "hidden_size must be an integer >= 1, got '64'"),
    ({**TINY_CONFIG, "num_hidden_layers": 2.5}, "num_hidden_layers must be an integer >= 1, got 2.5"),
    ({**TINY_CONFIG, "num_key_value_heads": 3}, "heads (4) must be a multiple of kv_heads (3)"),
    ({**TINY_CONFIG, "rope_theta": "big"}, "rope_theta must be a number > 0, got 'big'"),
    ({**TINY_CONFIG, "tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false, got 'yes'"),
    ({"text_config": 3}, "text_config must be a JSON object, got 3"),
    ({k: v for k, v in TINY_CONFIG.items() if k != "vocab_size"}, "not a dense decoder configuration, no 'vocab_size'"),
    ({**TINY_CONFIG, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768},
     "a mixture-of-experts configuration (num_experts, moe_intermediate_size)"),
])
def test_a_bad_hugging_face_config_is_refused_naming_file_and_key(tmp_path, config, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    for given in (path, tmp_path):  # the file, or the directory holding it
        with pytest.raises(ValueError) as err:
            model_shape(str(given))
        assert str(err.value).startswith(f"{path}: ") and message in str(err.value)


@pytest.mark.parametrize("k", [0, -1])
def test_a_roofline_for_drafts_of_no_tokens_is_refused(k):
    with pytest.raises(ValueError, match=f"--k must be >= 1, got {k}"):
        roofline_profile("h100", MODEL_SHAPES["tiny"], k=k)
