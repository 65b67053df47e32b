"""Shared fixtures: a tiny random causal LM with a locally trained tokenizer (no download)."""

import os

import pytest

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
