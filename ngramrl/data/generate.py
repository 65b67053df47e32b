"""Generate multi-epoch rollout traces with a real model (Hugging Face transformers, on a GPU
where there is one, else on the CPU; in the dtype the device computes fast in unless told).

Every epoch samples ``samples`` rollouts of every prompt with the same (unchanged) policy, the
regime of RL epochs without training in between, and the file is rewritten after each epoch so an
interrupted run keeps what it finished.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

from ngramrl.config import ENGINE_DTYPES
from ngramrl.core.trace import Rollout, TraceHeader, TraceWriter, model_vocab_size
from ngramrl.data.workloads import Task
from ngramrl.devices import resolve_dtype


@dataclass
class GenerationConfig:
    model_dir: str
    out_path: str
    workload: str
    temperature: float = 1.0
    top_p: float = 1.0
    samples: int = 4
    epochs: int = 4
    max_tokens: int = 256
    batch_size: int = 32
    seed: int = 0
    threads: int | None = None
    dtype: str = "auto"  # float32, bfloat16, float16; auto: ngramrl.devices.resolve_dtype for the device used

    def __post_init__(self) -> None:
        if self.dtype not in ENGINE_DTYPES:
            raise ValueError(f"dtype must be one of {ENGINE_DTYPES}, got {self.dtype!r}")
        for name in ("samples", "epochs", "max_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} (--{name.replace('_', '-')}) must be >= 1, got {getattr(self, name)}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature (--temperature) must be a number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:  # (NaN fails it too)
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def generate_trace(config: GenerationConfig, tasks: list[Task], progress: bool = True) -> str:
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if config.threads:
        torch.set_num_threads(config.threads)
    tokenizer = AutoTokenizer.from_pretrained(config.model_dir)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = resolve_dtype(config.dtype, on_cpu=device == "cpu")
    model = AutoModelForCausalLM.from_pretrained(config.model_dir, dtype=getattr(torch, dtype)).to(device)
    model.eval()
    eos_ids = sorted({tokenizer.eos_token_id, *([model.generation_config.eos_token_id]
                      if isinstance(model.generation_config.eos_token_id, int)
                      else (model.generation_config.eos_token_id or []))} - {None})
    prompts = {
        task.prompt_id: tokenizer.apply_chat_template(task.messages, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False)
        for task in tasks
    }
    prompts = {pid: list(ids["input_ids"] if isinstance(ids, dict) else ids) for pid, ids in prompts.items()}
    header = TraceHeader(
        vocab_size=model_vocab_size(config.model_dir, len(tokenizer)), eos_token_ids=eos_ids,
        model=os.path.basename(os.path.normpath(config.model_dir)), tokenizer=os.path.basename(
            os.path.normpath(config.model_dir)), workload=config.workload, temperature=config.temperature,
        top_p=config.top_p, top_k=-1, max_tokens=config.max_tokens, extra={"dtype": dtype},
    )
    writer = TraceWriter(config.out_path, header)
    jobs = [(pid, sample) for pid in prompts for sample in range(config.samples)]
    total = len(jobs) * config.epochs
    bar = tqdm(total=total, desc=f"generate {config.workload} T={config.temperature}", disable=not progress,
               unit="rollout")
    start = time.time()
    new_tokens = 0
    for epoch in range(config.epochs):
        torch.manual_seed(config.seed * 1_000_003 + epoch)
        # Group similar lengths together so left padding wastes little.
        ordered = sorted(jobs, key=lambda job: len(prompts[job[0]]))
        for first in range(0, len(ordered), config.batch_size):
            chunk = ordered[first:first + config.batch_size]
            batch = tokenizer.pad({"input_ids": [prompts[pid] for pid, _ in chunk]}, return_tensors="pt").to(device)
            with torch.no_grad():
                out = model.generate(
                    **batch, max_new_tokens=config.max_tokens, do_sample=config.temperature > 0,
                    temperature=config.temperature if config.temperature > 0 else None,
                    top_p=config.top_p, top_k=0, eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id,
                )
            generated = out[:, batch["input_ids"].shape[1]:].tolist()
            for (pid, sample), tokens in zip(chunk, generated, strict=True):
                cut = next((i + 1 for i, t in enumerate(tokens) if t in eos_ids), None)
                output = tokens[:cut] if cut else tokens
                new_tokens += len(output)
                writer.add(Rollout(pid, epoch, sample, prompts[pid], output,
                                   "stop" if cut else "length"))
            bar.update(len(chunk))
            bar.set_postfix(tok_s=f"{new_tokens / (time.time() - start):.0f}")
        writer.flush()
    bar.close()
    return config.out_path
