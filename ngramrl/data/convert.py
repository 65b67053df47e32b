"""Rollouts an RL framework logged (JSON lines of prompt and output, as text or token ids, with the
training step) turned into a trace (docs/trace-format.md), so ``ngramrl bench`` measures drafting
on them before anyone changes their training.

The defaults read veRL's rollout dumps (``trainer.rollout_data_dir``: one ``{step}.jsonl`` per step,
``{"input": ..., "output": ..., "score": ..., "step": ...}``); other layouts name their keys.
Texts are tokenized without adding special tokens: a dump decoded with its special tokens skipped
loses the chat template's markers, which changes the prompt's last tokens but not what the outputs
repeat of each other, which is what drafting from history lives on."""

from __future__ import annotations

import gzip
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from ngramrl.core.trace import MAX_TOKEN_ID, Rollout, TraceHeader, is_gzip


class RolloutsError(ValueError):
    """A logged rollout that cannot be converted: the file, its line and what is wrong."""

    def __init__(self, path: str, line: int, problem: str) -> None:
        super().__init__(f"{path}:{line}: {problem}")


@dataclass
class RolloutKeys:
    """Where each record keeps what a trace needs."""

    prompt: str = "input"
    output: str = "output"
    epoch: str = "step"              # the training step (or epoch) that generated it
    prompt_id: str | None = None     # None: rollouts with the same prompt are the same prompt
    reward: str | None = "score"     # kept when present and a finite number


@dataclass
class _Record:
    prompt_id: str
    epoch: int
    prompt: list[int]
    output: list[int]
    reward: float | None
    where: str  # file:line


def _tokens(value: Any, tokenizer: Any, what: str, path: str, line: int) -> list[int]:
    if isinstance(value, str):
        if tokenizer is None:
            raise RolloutsError(path, line, f"{what} is text: give --tokenizer to turn it into token ids")
        return list(tokenizer(value, add_special_tokens=False)["input_ids"])
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID
                                       for t in value):
        return value
    raise RolloutsError(path, line, f"{what} must be text or a list of token ids in [0, 2^31) (32-bit, as engines "
                                    f"take them), got {str(value)[:80]!r}")


def _open(path: str) -> Any:
    return gzip.open(path, "rt", encoding="utf-8") if is_gzip(path) else open(path, encoding="utf-8")


def read_logged_rollouts(paths: list[str], keys: RolloutKeys, tokenizer: Any = None) -> list[Rollout]:
    """Every record of every file, checked (a bad one raises with its file and line before any
    trace is written); epochs counted from the first step seen, samples numbered in file order
    within their prompt and epoch."""
    records: list[_Record] = []
    for path in paths:
        with _open(path) as handle:
            for line_number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as err:
                    raise RolloutsError(path, line_number, f"not JSON ({err})") from None
                if not isinstance(record, dict):
                    raise RolloutsError(path, line_number, "a rollout must be a JSON object")
                for key in (keys.prompt, keys.output, keys.epoch, keys.prompt_id):
                    if key is not None and key not in record:
                        raise RolloutsError(path, line_number, f"no {key!r} (its keys: {', '.join(sorted(record))}); "
                                                               f"name the right one with its --*-key option")
                epoch = record[keys.epoch]
                if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
                    raise RolloutsError(path, line_number, f"{keys.epoch} must be an integer >= 0, got {epoch!r}")
                prompt = _tokens(record[keys.prompt], tokenizer, keys.prompt, path, line_number)
                output = _tokens(record[keys.output], tokenizer, keys.output, path, line_number)
                if keys.prompt_id is not None:
                    prompt_id = record[keys.prompt_id]
                    if isinstance(prompt_id, bool) or not isinstance(prompt_id, (str, int)):
                        raise RolloutsError(path, line_number, f"{keys.prompt_id} must be a string or an integer "
                                                               f"(the prompt's id), got {prompt_id!r}")
                    prompt_id = str(prompt_id)
                else:  # the same prompt, the same id: hashed from its tokens
                    prompt_id = "p-" + hashlib.sha1(json.dumps(prompt).encode()).hexdigest()[:16]
                reward = record.get(keys.reward) if keys.reward else None
                if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
                    reward = None
                records.append(_Record(prompt_id, epoch, prompt, output, reward, f"{path}:{line_number}"))
    if not records:
        raise ValueError(f"no rollouts in {', '.join(paths)}")
    first = min(r.epoch for r in records)
    prompts: dict[str, _Record] = {}
    samples: dict[tuple[str, int], int] = {}
    rollouts = []
    for r in records:
        if prompts.setdefault(r.prompt_id, r).prompt != r.prompt:
            raise ValueError(f"{r.where}: prompt id {r.prompt_id!r} names another prompt than at "
                             f"{prompts[r.prompt_id].where} (a trace's prompt id is one prompt)")
        sample = samples.get((r.prompt_id, r.epoch), 0)
        samples[(r.prompt_id, r.epoch)] = sample + 1
        rollouts.append(Rollout(r.prompt_id, r.epoch - first, sample, r.prompt, r.output, reward=r.reward))
    return rollouts


def trace_header(rollouts: list[Rollout], tokenizer: Any = None, model_dir: str | None = None,
                 name: str | None = None) -> TraceHeader:
    """The header for converted rollouts: the tokenizer's vocabulary (the model's padded one where
    its config.json is at hand) and end-of-sequence id; without a tokenizer, the ids seen."""
    from ngramrl.core.trace import model_vocab_size

    largest = max((max(r.prompt + r.output, default=0) for r in rollouts), default=0)
    if tokenizer is None:
        return TraceHeader(vocab_size=largest + 1, eos_token_ids=[])
    size = len(tokenizer)
    if model_dir is not None:
        size = model_vocab_size(model_dir, size)
    if largest >= size:
        raise ValueError(f"token id {largest} is outside the tokenizer's vocabulary ({size}): the rollouts' "
                         f"token ids are of another tokenizer")
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return TraceHeader(vocab_size=size, eos_token_ids=eos, tokenizer=name, model=name)
