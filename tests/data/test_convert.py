"""Logged rollouts (veRL's dumps by default) turned into a trace that ``ngramrl bench`` replays."""

import gzip
import json

import pytest

from ngramrl.cli import main
from ngramrl.core.trace import read_trace

QUESTIONS = ["what is two plus two", "name a prime number"]


def write_jsonl(path, records, gzipped=False):
    opener = gzip.open if gzipped else open
    with opener(path, "wt", encoding="utf-8") as handle:
        for record in records:
            handle.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return str(path)


def verl_dump(tmp_path, step, outputs):
    """veRL's ``rollout_data_dir/{step}.jsonl``: input, output, score, step per rollout."""
    records = [{"input": QUESTIONS[i % 2], "output": text, "score": float(i % 2), "step": step, "gts": "4"}
               for i, text in enumerate(outputs)]
    return write_jsonl(tmp_path / f"{step}.jsonl", records)


def test_veRL_dumps_become_a_trace_that_bench_replays(tiny_model_dir, tmp_path, capsys):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    answers = ["two plus two is four", "seven is a prime number", "it is four", "three is prime"]
    files = [verl_dump(tmp_path, step, answers) for step in (1, 2, 3)]
    out = str(tmp_path / "trace.jsonl.gz")
    assert main(["to-trace", *files, "--tokenizer", tiny_model_dir, "--out", out]) == 0
    assert "12 rollouts of 2 prompts over 3 epochs" in capsys.readouterr().out
    trace = read_trace(out)
    assert trace.header.vocab_size >= len(tokenizer) and trace.header.eos_token_ids == [tokenizer.eos_token_id]
    # steps 1-3 are epochs 0-2; the two rollouts of a prompt in a step are its samples 0 and 1
    assert sorted((r.epoch, r.sample) for r in trace.rollouts) == [(e, s) for e in range(3) for s in (0, 1)
                                                                   for _ in range(2)]
    by_prompt = {}
    for rollout in trace.rollouts:
        by_prompt.setdefault(rollout.prompt_id, set()).add(tuple(rollout.prompt))
    assert len(by_prompt) == 2 and all(len(prompts) == 1 for prompts in by_prompt.values())
    first = [r for r in trace.rollouts if r.epoch == 0 and r.sample == 0]
    assert {tuple(r.output) for r in first} == {tuple(tokenizer(answers[i], add_special_tokens=False)["input_ids"])
                                                for i in (0, 1)}
    assert {r.reward for r in trace.rollouts} == {0.0, 1.0}
    assert main(["bench", out, "--method", "ngramrl", "--method", "pld", "--k", "4", "--no-progress"]) == 0
    capsys.readouterr()
    one_step = str(tmp_path / "one-step.jsonl.gz")
    assert main(["to-trace", files[0], "--tokenizer", tiny_model_dir, "--out", one_step]) == 0
    printed = capsys.readouterr().out
    hint = printed.split("replay it with: ")[1].split()
    assert "over 1 epoch;" in printed and hint[-2:] == ["--regime", "siblings"]
    assert main([*hint[1:], "--no-progress"]) == 0  # the hint it gives works on what it wrote


def test_token_ids_need_no_tokenizer_and_keys_can_be_named(tmp_path):
    records = [{"prompt_ids": [5, 6, 7], "response_ids": [8, 9, 10, 11], "epoch": e, "uid": "q1"} for e in (0, 0, 1)]
    path = write_jsonl(tmp_path / "ids.jsonl.gz", records, gzipped=True)
    out = str(tmp_path / "ids-trace.jsonl")
    assert main(["to-trace", path, "--prompt-key", "prompt_ids", "--output-key", "response_ids",
                 "--epoch-key", "epoch", "--prompt-id-key", "uid", "--out", out]) == 0
    trace = read_trace(out)
    assert trace.header.vocab_size == 12
    assert [(r.prompt_id, r.epoch, r.sample, r.output) for r in trace.rollouts] == [
        ("q1", 0, 0, [8, 9, 10, 11]), ("q1", 0, 1, [8, 9, 10, 11]), ("q1", 1, 0, [8, 9, 10, 11])]


@pytest.mark.parametrize("lines, args, message", [
    (['{"input": "a", "output": "b", "step": 1}', "{not json"], [], "bad.jsonl:2: not JSON"),
    (['{"input": "a", "output": "b"}'], [], "bad.jsonl:1: no 'step' (its keys: input, output)"),
    (['{"input": "a", "output": "b", "step": -1}'], [], "bad.jsonl:1: step must be an integer >= 0, got -1"),
    (['{"input": "a", "output": "b", "step": 1}'], ["--no-tokenizer"],
     "bad.jsonl:1: input is text: give --tokenizer"),
    (['{"input": [1, -2], "output": [3], "step": 1}'], ["--no-tokenizer"],
     "bad.jsonl:1: input must be text or a list of token ids in [0, 2^31)"),
    (['{"input": [1], "output": [2147483648], "step": 1}'], ["--no-tokenizer"],
     "bad.jsonl:1: output must be text or a list of token ids in [0, 2^31)"),
    (['{"input": [1], "output": [3], "step": 1, "id": "x"}', '{"input": [2], "output": [3], "step": 1, "id": "x"}'],
     ["--no-tokenizer", "--prompt-id-key", "id"],
     "bad.jsonl:2: prompt id 'x' names another prompt than at bad.jsonl:1"),
    (['{"input": [1], "output": [3], "step": 1, "id": null}'], ["--no-tokenizer", "--prompt-id-key", "id"],
     "bad.jsonl:1: id must be a string or an integer (the prompt's id), got None"),
    (['{"input": [1], "output": [9999], "step": 1}'], [], "token id 9999 is outside the tokenizer's vocabulary"),
])
def test_a_bad_rollout_is_named_by_file_and_line_and_nothing_is_written(tiny_model_dir, tmp_path, capsys,
                                                                      lines, args, message):
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    out = tmp_path / "t.jsonl.gz"
    tokenizer = [] if "--no-tokenizer" in args else ["--tokenizer", tiny_model_dir]
    rest = [a for a in args if a != "--no-tokenizer"]
    assert main(["to-trace", path, *tokenizer, *rest, "--out", str(out)]) == 2
    assert message in capsys.readouterr().err.replace(str(tmp_path) + "/", "")
    assert not out.exists()


def test_an_existing_trace_is_kept_unless_told_to_overwrite_it(tmp_path, capsys):
    path = write_jsonl(tmp_path / "r.jsonl", ['{"input": [1], "output": [2], "step": 0}'])
    out = tmp_path / "t.jsonl"
    out.write_text("earlier")
    assert main(["to-trace", path, "--out", str(out)]) == 2
    assert "exists" in capsys.readouterr().err and out.read_text() == "earlier"
    assert main(["to-trace", path, "--out", str(out), "--overwrite"]) == 0
    assert len(read_trace(str(out)).rollouts) == 1
