import json

import pytest

from ngramrl.cli import main
from ngramrl.core.trace import Rollout, TraceHeader, write_trace


def small_trace(path):
    prompt = [1, 2, 3]
    rollouts = []
    for epoch in range(3):
        for sample in range(2):
            rollouts.append(Rollout("a", epoch, sample, prompt, [10, 11, 12, 13, 14 + sample, 15, 2], "stop"))
            rollouts.append(Rollout("b", epoch, sample, [1, 2, 4], [20, 21, 22, 23, 2], "stop"))
    write_trace(str(path), TraceHeader(vocab_size=100, eos_token_ids=[2], workload="toy"), rollouts)
    return str(path)


def test_bench_writes_contract_json_table_and_plot(tmp_path, capsys):
    trace = small_trace(tmp_path / "toy.jsonl.gz")
    out = tmp_path / "out.json"
    plot = tmp_path / "plot.png"
    code = main(["bench", trace, "--k", "16", "--k", "8", "--json", str(out), "--plot", str(plot), "--no-progress"])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["ngramrl_bench"] == 1
    runs = data["runs"]
    methods = ("ngramrl", "suffix", "pld", "none", "oracle", "oracle-prompt")
    assert {(r["method"], r["k"]) for r in runs} == {(m, k) for m in methods for k in (16, 8)}
    for run in runs:
        assert run["workload"] == "toy" and run["trace"] == trace and run["rollouts"] == 8
        assert run["tokens_per_forward"] == round(run["tokens"] / run["forwards"], 4)
        assert set(run) >= {"trace", "workload", "method", "k", "rollouts", "tokens", "forwards",
                            "tokens_per_forward", "coverage", "draft_us_per_step"}
    table = capsys.readouterr().out
    assert "ngramrl" in table and "x suffix" in table
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_reports_a_bad_trace_with_file_and_line(tmp_path, capsys):
    good = small_trace(tmp_path / "good.jsonl")
    bad = tmp_path / "bad.jsonl"
    lines = open(good).read().splitlines()
    lines[3] = lines[3].replace('"epoch":0', '"epoch":"zero"')
    bad.write_text("\n".join(lines) + "\n")
    code = main(["bench", good, str(bad), "--no-progress"])
    assert code == 2
    err = capsys.readouterr().err
    assert f"{bad}:4:" in err and "'epoch' must be an integer" in err


def test_bench_rejects_unknown_method(tmp_path, capsys):
    trace = small_trace(tmp_path / "toy.jsonl")
    assert main(["bench", trace, "--method", "medusa", "--no-progress"]) == 2
    assert "unknown method 'medusa'" in capsys.readouterr().err


def test_bench_steps_writes_its_contract_json(tmp_path, capsys):
    trace = small_trace(tmp_path / "toy.jsonl.gz")
    out = tmp_path / "steps.json"
    code = main(["bench-steps", trace, "--batch", "1", "3", "--threads", "2", "--method", "ngramrl", "suffix",
                 "--flush-mb", "1", "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["ngramrl_bench_steps"] == 1
    keys = {"trace", "method", "batch", "threads", "steps", "step_us_median", "step_us_mean", "step_us_p99",
            "request_us_mean", "offpath_us_mean", "tokens_per_forward"}
    assert {(r["method"], r["batch"]) for r in data["runs"]} == {(m, b) for m in ("ngramrl", "suffix") for b in (1, 3)}
    for run in data["runs"]:
        assert set(run) == keys and run["trace"] == trace and run["steps"] > 0
        assert run["threads"] == (2 if run["method"] == "ngramrl" else 1)
        assert run["step_us_median"] <= run["step_us_p99"] and run["tokens_per_forward"] >= 1.0
    assert "ngramrl" in capsys.readouterr().out


def test_bench_steps_and_project_check_their_output_before_any_work(tmp_path, capsys):
    trace = small_trace(tmp_path / "toy.jsonl.gz")
    missing = tmp_path / "no-such-folder" / "out.json"
    assert main(["bench-steps", trace, "--batch", "4", "--json", str(missing)]) == 2
    assert f"cannot write {missing}" in capsys.readouterr().err
    profile = tmp_path / "p.json"
    assert main(["profile-gpu", "--roofline", "h100", "--model", "qwen3-8b", "--out", str(profile)]) == 0
    assert main(["project", trace, "--profile", str(profile), "--engine-batch", "2", "--json", str(missing)]) == 2
    assert f"cannot write {missing}" in capsys.readouterr().err
    assert main(["profile-gpu", "--roofline", "tpu", "--out", str(profile)]) == 2
    assert "--roofline 'tpu'" in capsys.readouterr().err


def test_project_writes_its_contract_json_and_says_it_is_a_projection(tmp_path, capsys):
    trace = small_trace(tmp_path / "toy.jsonl.gz")
    profile = tmp_path / "h100.json"
    assert main(["profile-gpu", "--roofline", "h100", "--model", "qwen3-8b", "--out", str(profile)]) == 0
    out = tmp_path / "projection.json"
    # --cpu-scale 0: the drafting time does not count, so the drafting decisions do not depend on
    # how busy this machine is
    code = main(["project", trace, "--profile", str(profile), "--engine-batch", "1", "4",
                 "--method", "ngramrl", "pld", "--flush-mb", "1", "--cpu-scale", "0", "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "PROJECTION, not a measurement" in printed
    data = json.loads(out.read_text())
    assert data["ngramrl_project"] == 1 and data["profile"]["source"] == "roofline" and "partial" not in data
    keys = {"trace", "method", "engine_batch", "rollout_seconds", "speedup_vs_none", "tokens_per_forward", "steps",
            "draft_ms_per_step"}
    runs = {(r["method"], r["engine_batch"]): r for r in data["runs"]}
    assert set(runs) == {(m, b) for m in ("none", "ngramrl", "pld") for b in (1, 4)}
    for run in runs.values():
        assert set(run) >= keys and run["draft_ms_per_step"] == 0.0
    assert data["profile"]["cpu_scale"] == 0.0
    for batch in (1, 4):
        none = runs[("none", batch)]
        assert none["speedup_vs_none"] == 1.0 and none["tokens_per_forward"] == 1.0
        ngramrl = runs[("ngramrl", batch)]
        ratio = none["rollout_seconds"] / ngramrl["rollout_seconds"]
        assert ngramrl["speedup_vs_none"] == pytest.approx(ratio, rel=1e-3)
        # every step reads the weights at least once: no faster than the floor
        assert ngramrl["rollout_seconds"] >= ngramrl["steps"] * data["profile"]["floor_ms"] / 1000
    # the repeated samples make ngramrl's drafts pay at batch 1, where verifying is nearly free
    assert runs[("ngramrl", 1)]["tokens_per_forward"] > 1.2 and runs[("ngramrl", 1)]["speedup_vs_none"] > 1.0


def test_project_skips_a_method_whose_package_is_missing_and_says_so(tmp_path, capsys, monkeypatch):
    import ngramrl.bench.project as project

    monkeypatch.setattr(project, "method_available", lambda m: "arctic-inference is not installed"
                        if m == "suffix" else None)
    trace = small_trace(tmp_path / "toy.jsonl.gz")
    profile = tmp_path / "h100.json"
    assert main(["profile-gpu", "--roofline", "h100", "--out", str(profile)]) == 0
    out = tmp_path / "projection.json"
    assert main(["project", trace, "--profile", str(profile), "--engine-batch", "2", "--method", "suffix", "pld",
                 "--flush-mb", "0", "--json", str(out)]) == 0
    assert "skipping suffix: arctic-inference is not installed" in capsys.readouterr().out
    assert {r["method"] for r in json.loads(out.read_text())["runs"]} == {"none", "pld"}
