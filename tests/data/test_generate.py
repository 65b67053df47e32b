import pytest
import torch

from ngramrl.cli import main
from ngramrl.core.trace import read_trace
from ngramrl.data.generate import GenerationConfig, generate_trace
from ngramrl.data.workloads import Task, load_tasks
from ngramrl.devices import resolve_dtype


def test_generate_writes_a_valid_multi_epoch_trace(tiny_model_dir, tmp_path):
    tasks = [Task(f"t{i}", [{"role": "user", "content": f"question {i}"}]) for i in range(3)]
    out = str(tmp_path / "trace.jsonl.gz")
    config = GenerationConfig(model_dir=tiny_model_dir, out_path=out, workload="toy", temperature=1.0,
                              samples=2, epochs=2, max_tokens=12, batch_size=4)
    generate_trace(config, tasks, progress=False)
    trace = read_trace(out)
    assert trace.header.workload == "toy" and trace.header.temperature == 1.0
    # what the model ran in
    assert trace.header.extra["dtype"] == resolve_dtype("auto", on_cpu=not torch.cuda.is_available())
    assert len(trace.rollouts) == 3 * 2 * 2
    assert {(r.prompt_id, r.epoch, r.sample) for r in trace.rollouts} == {
        (f"t{i}", e, s) for i in range(3) for e in range(2) for s in range(2)}
    for rollout in trace.rollouts:
        assert 1 <= len(rollout.output) <= 12
        assert rollout.finish_reason in ("stop", "length")
        if rollout.finish_reason == "stop":
            assert rollout.output[-1] in trace.header.eos_token_ids
    # The trace replays through the benchmark.
    assert main(["bench", out, "--method", "ngramrl", "--method", "none", "--no-progress"]) == 0


def test_generate_runs_in_the_dtype_asked_for_and_refuses_an_unknown_one(tiny_model_dir, tmp_path):
    tasks = [Task("t0", [{"role": "user", "content": "question"}])]
    out = str(tmp_path / "trace.jsonl.gz")
    other = "float32" if resolve_dtype("auto", on_cpu=not torch.cuda.is_available()) == "bfloat16" else "bfloat16"
    generate_trace(GenerationConfig(model_dir=tiny_model_dir, out_path=out, workload="toy", samples=1, epochs=1,
                                    max_tokens=4, dtype=other), tasks, progress=False)
    assert read_trace(out).header.extra["dtype"] == other
    with pytest.raises(ValueError, match="dtype must be one of"):
        GenerationConfig(model_dir=tiny_model_dir, out_path=out, workload="toy", dtype="fp8")


def test_workloads_load_offline_with_references():
    gsm = load_tasks("gsm", 3, seed=1)
    assert len(gsm) == 3 and gsm[0].reference["answer"]
    bfcl = load_tasks("bfcl", 3, seed=1)
    assert len(bfcl) == 3 and "Available functions" in bfcl[0].messages[0]["content"]
    assert bfcl[0].reference["ground_truth"]


def test_spider_tasks_carry_schema_and_gold_sql(spider_dir):
    tasks = load_tasks("spider", 4, seed=0, spider_dir=spider_dir)
    assert len(tasks) == 4
    for task in tasks:
        assert "CREATE TABLE" in task.messages[1]["content"]
        assert task.reference["gold_sql"] and task.reference["db_path"].endswith(".sqlite")


def test_spider_without_a_directory_is_a_clear_error(tmp_path, capsys):
    assert main(["generate", "--workload", "spider", "--out", str(tmp_path / "x.jsonl"),
                 "--spider-dir", str(tmp_path)]) == 2
    assert "train_spider.json" in capsys.readouterr().err
