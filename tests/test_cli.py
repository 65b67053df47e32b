import json
import os
import re

import numpy as np
import pytest

from ngramrl.bench.run import measure_history_memory
from ngramrl.cli import main
from ngramrl.config import HistoryConfig, PrefetchConfig
from ngramrl.core.extension import native_module
from ngramrl.core.trace import Rollout, TraceHeader, read_trace, write_trace


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
    assert data["machine"]["native_core"] == (native_module() is not None) and data["machine"]["usable_cpus"] >= 1
    runs = data["runs"]
    methods = ("ngramrl", "ngramrl-tree", "suffix", "pld", "none", "oracle", "oracle-prompt")
    assert {(r["method"], r["k"]) for r in runs} == {(m, k) for m in methods for k in (16, 8)}
    for run in runs:
        assert run["workload"] == "toy" and run["trace"] == trace and run["rollouts"] == 8
        assert run["tokens_per_forward"] == round(run["tokens"] / run["forwards"], 4)
        assert set(run) >= {"trace", "workload", "method", "k", "rollouts", "tokens", "forwards",
                            "tokens_per_forward", "coverage", "draft_us_per_step", "critical_us_per_step", "regime"}
        # all the method's CPU per step, its background too, against the part on the critical path
        assert run["critical_us_per_step"] <= run["draft_us_per_step"]
        assert ("tree_width" in run) == (run["method"] == "ngramrl-tree")
    table = capsys.readouterr().out
    assert "ngramrl" in table and "x suffix" in table
    assert table.startswith(f"machine: {data['machine']['cpu']}")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the memory of the core that drafted: the Python reference's is measured only where it drafts
    memory = data["ngramrl_memory"][trace]
    both = measure_history_memory(read_trace(trace), HistoryConfig(), reference=True)
    assert both["stored_tokens"] > 0 and both["bytes_per_token"] > 0
    if native_module() is not None:
        assert set(memory) == {"native"} and "Python reference memory" not in table
        assert memory["native"]["stored_tokens"] == both["stored_tokens"] and memory["native"]["bytes_per_token"] > 0
    else:
        assert memory["stored_tokens"] == both["stored_tokens"] and "Python reference memory" in table


def test_bench_siblings_regime_replays_every_prompt_epoch_from_its_siblings_only(tmp_path, capsys):
    from ngramrl.bench.siblings import make_sibling_method, replay_siblings
    from ngramrl.core.trace import read_trace

    trace = small_trace(tmp_path / "toy.jsonl.gz")
    out = tmp_path / "out.json"
    assert main(["bench", trace, "--regime", "siblings", "--k", "8", "--json", str(out), "--no-progress"]) == 0
    data = json.loads(out.read_text())
    assert data["regime"] == "siblings"
    runs = {r["method"]: r for r in data["runs"]}
    assert set(runs) == {"ngramrl", "suffix", "pld", "none"}
    assert all(r["rollouts"] == 12 for r in runs.values())  # epoch 0 too: nothing earlier is drafted from
    direct = replay_siblings(read_trace(trace), make_sibling_method("ngramrl"), 8)
    assert runs["ngramrl"]["forwards"] == direct.forwards <= runs["none"]["forwards"]
    assert "regime: siblings" in capsys.readouterr().out
    assert main(["bench", trace, "--regime", "siblings", "--method", "oracle", "--no-progress"]) == 2
    assert "not in the siblings regime" in capsys.readouterr().err


def test_bench_by_epoch_splits_the_replay_epoch_by_epoch(tmp_path, capsys):
    trace = small_trace(tmp_path / "toy.jsonl.gz")
    out = tmp_path / "out.json"
    assert main(["bench", trace, "--by-epoch", "--method", "ngramrl", "--method", "pld", "--json", str(out),
                 "--no-progress"]) == 0
    data = json.loads(out.read_text())
    series = {s["method"]: s for s in data["by_epoch"][trace]["16"]}
    assert set(series) == {"ngramrl", "pld"}
    whole = {r["method"]: r for r in data["runs"]}
    for name, one in series.items():
        assert set(one["forwards"]) == {"1", "2"}  # the epochs replayed
        assert sum(one["forwards"].values()) == whole[name]["forwards"]
        assert sum(one["tokens"].values()) == whole[name]["tokens"]
    assert "tokens per forward by epoch" in capsys.readouterr().out

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
    methods = ("ngramrl", "ngramrl-prefetch", "suffix")
    code = main(["bench-steps", trace, "--batch", "1", "3", "--threads", "2", "--method", *methods,
                 "--flush-mb", "1", "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["ngramrl_bench_steps"] == 1
    machine = data["machine"]
    assert set(machine) == {"cpu", "logical_cpus", "usable_cpus", "native_core", "python", "platform"}
    assert 1 <= machine["usable_cpus"] <= machine["logical_cpus"]
    assert machine["native_core"] == (native_module() is not None)
    printed = capsys.readouterr().out
    assert (f"machine: {machine['cpu']}, {machine['usable_cpus']} of {machine['logical_cpus']} logical CPUs usable"
            in printed)
    keys = {"trace", "method", "batch", "threads", "steps", "step_us_median", "step_us_mean", "step_us_p99",
            "request_us_mean", "offpath_us_mean", "tokens_per_forward", "prefetch_coverage", "resumed_misses",
            "budget", "max_budget", "budget_mean", "repeat"}
    assert {(r["method"], r["batch"]) for r in data["runs"]} == {(m, b) for m in methods for b in (1, 3)}
    assert data["repeats"] == 1 and "summary" not in data and {r["repeat"] for r in data["runs"]} == {0}
    for run in data["runs"]:
        assert set(run) == keys and run["trace"] == trace and run["steps"] > 0
        assert run["threads"] == (1 if run["method"] == "suffix" else 2)
        assert run["budget"] == (PrefetchConfig().budget if run["method"] == "ngramrl-prefetch" else None)
        assert run["max_budget"] == (PrefetchConfig().max_budget if run["method"] == "ngramrl-prefetch" else None)
        if run["method"] == "ngramrl-prefetch" and run["budget_mean"] is not None:  # None: no background prefetch
            assert PrefetchConfig().budget <= run["budget_mean"] <= PrefetchConfig().max_budget
        else:
            assert run["budget_mean"] is None
        assert run["step_us_median"] <= run["step_us_p99"] and run["tokens_per_forward"] >= 1.0
        coverage = run["prefetch_coverage"]
        if run["method"] == "suffix":
            assert coverage is None
        elif run["method"] == "ngramrl":
            assert coverage == 0.0
        else:
            assert 0.0 <= coverage <= 1.0
        resumed = run["resumed_misses"]
        if run["method"] == "suffix":
            assert resumed is None
        elif run["method"] == "ngramrl":
            assert resumed in (0.0, None)  # no prefetch walked anything (None: the reference core)
        else:
            assert resumed is None or 0.0 <= resumed <= 1.0
    assert "ngramrl" in printed
    assert data["draft_always"] is False


def test_bench_steps_repeats_the_grid_in_alternating_order_and_summarizes_each_run(tmp_path, capsys):
    trace = small_trace(tmp_path / "toy.jsonl.gz")
    out = tmp_path / "steps.json"
    assert main(["bench-steps", trace, "--batch", "3", "--method", "ngramrl", "suffix", "--repeats", "3",
                 "--flush-mb", "0", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["repeats"] == 3
    order = [(r["method"], r["repeat"]) for r in data["runs"]]
    assert order == [("ngramrl", 0), ("suffix", 0), ("suffix", 1), ("ngramrl", 1), ("ngramrl", 2), ("suffix", 2)]
    summary = {entry["method"]: entry for entry in data["summary"]}
    means = {m: [r["step_us_mean"] for r in sorted(data["runs"], key=lambda r: r["repeat"]) if r["method"] == m]
             for m in ("ngramrl", "suffix")}
    for method, entry in summary.items():
        assert (entry["repeats"], entry["batch"], entry["trace"]) == (3, 3, trace)
        assert entry["step_us_mean"] == pytest.approx(sorted(means[method])[1], abs=1e-3)
        assert (entry["step_us_mean_min"], entry["step_us_mean_max"]) == (min(means[method]), max(means[method]))
    paired = sorted(s / n for s, n in zip(means["suffix"], means["ngramrl"], strict=True))[1]
    assert summary["suffix"]["step_mean_ratio"] == pytest.approx(paired, abs=1e-4)
    assert summary["ngramrl"]["step_mean_ratio"] == 1.0
    assert "over 3 repeats" in capsys.readouterr().out
    assert main(["bench-steps", trace, "--batch", "3", "--repeats", "0"]) == 2


def test_bench_steps_runs_the_drafter_pool_on_real_shard_actors_and_stops_them(tmp_path):
    """ngramrl-pool: PoolProposer drafting from DrafterShard actors on a local Ray instance, as
    `ngramrl train` runs it; the instance it started is gone after the run."""
    ray = pytest.importorskip("ray")
    trace = small_trace(tmp_path / "toy.jsonl.gz")
    out = tmp_path / "steps.json"
    assert main(["bench-steps", trace, "--batch", "3", "--method", "ngramrl-prefetch", "ngramrl-pool", "--draft-always",
                 "--pool-shards", "1", "--pool-sync-wait-ms", "10000", "--flush-mb", "0", "--json", str(out)]) == 0
    assert not ray.is_initialized()
    data = json.loads(out.read_text())
    assert data["pool"] == {"shards": 1, "sync_wait_ms": 10000.0}
    runs = {run["method"]: run for run in data["runs"]}
    pool = runs["ngramrl-pool"]
    assert (pool["threads"], pool["budget"], pool["late_syncs"], pool["unsynced_prompts"]) == (
        1, PrefetchConfig().budget, 0, 0)
    assert pool["steps"] > 0 and 0.0 <= pool["prefetch_coverage"] <= 1.0
    assert pool["sync_calls"] > 0 and pool["sync_us_median"] > 0
    # one shard holds the history the engine's own core holds: on this trace the same drafts, step by
    # step (within a phase the pool has a finished rollout only once the driver sends it)
    assert pool["tokens_per_forward"] == runs["ngramrl-prefetch"]["tokens_per_forward"] > 1.0
    assert pool["steps"] == runs["ngramrl-prefetch"]["steps"]
    assert main(["bench-steps", trace, "--batch", "3", "--method", "ngramrl-pool", "--pool-shards", "0"]) == 2


def test_bench_steps_without_the_pipelines_pool_start_says_where_it_is(tmp_path):
    """The benchmarks sit below the pipeline: a caller that asks for ngramrl-pool hands them the
    pipeline's start_pool_engine, and one that does not is told so before any run starts."""
    pytest.importorskip("ray")
    from ngramrl.bench.bench_steps import BenchStepsConfig, run_bench_steps

    trace = small_trace(tmp_path / "toy.jsonl.gz")
    out = tmp_path / "steps.json"
    message = "ngramrl-pool needs PoolBench(start=...): the pipeline's start_pool_engine"
    with pytest.raises(ValueError, match=re.escape(message)):
        run_bench_steps(BenchStepsConfig(traces=[trace], batches=[3], methods=["ngramrl", "ngramrl-pool"],
                                         json_out=str(out)))
    assert not out.exists()


def test_bench_steps_runs_the_prefetching_method_once_per_budget(tmp_path, monkeypatch):
    from ngramrl.bench import bench_steps

    built = []
    build = bench_steps.build_engine

    def spy(method, *args, config, **kwargs):
        built.append((method, config.prefetch.budget))
        return build(method, *args, config=config, **kwargs)

    monkeypatch.setattr(bench_steps, "build_engine", spy)
    trace = small_trace(tmp_path / "toy.jsonl.gz")
    out = tmp_path / "steps.json"
    assert main(["bench-steps", trace, "--batch", "3", "--method", "ngramrl", "ngramrl-prefetch", "--budget", "2",
                 "48", "--flush-mb", "0", "--json", str(out)]) == 0
    runs = [(r["method"], r["budget"]) for r in json.loads(out.read_text())["runs"]]
    assert runs == [("ngramrl", None), ("ngramrl-prefetch", 2), ("ngramrl-prefetch", 48)]
    assert built == [("ngramrl", PrefetchConfig().budget), ("ngramrl-prefetch", 2), ("ngramrl-prefetch", 48)]
    assert main(["bench-steps", trace, "--batch", "3", "--budget", "0"]) == 2
    assert main(["bench-steps", trace, "--batch", "3", "--max-budget", "-1"]) == 2


def test_bench_steps_runs_each_budget_with_each_max_budget(tmp_path, monkeypatch):
    from ngramrl.bench import bench_steps

    built = []
    build = bench_steps.build_engine

    def spy(method, *args, config, **kwargs):
        built.append((method, config.prefetch.budget, config.prefetch.max_budget))
        return build(method, *args, config=config, **kwargs)

    monkeypatch.setattr(bench_steps, "build_engine", spy)
    trace = small_trace(tmp_path / "toy.jsonl.gz")
    out = tmp_path / "steps.json"
    assert main(["bench-steps", trace, "--batch", "3", "--method", "ngramrl-prefetch", "--budget", "4", "8",
                 "--max-budget", "8", "32", "--flush-mb", "0", "--json", str(out)]) == 0
    runs = [(r["budget"], r["max_budget"]) for r in json.loads(out.read_text())["runs"]]
    assert runs == [(4, 8), (4, 32), (8, 8), (8, 32)]
    assert [b[1:] for b in built] == runs


def test_bench_steps_can_draft_at_every_step(tmp_path, monkeypatch):
    """--draft-always: the step-cost model is off, so every row drafts k tokens and keeps them."""
    from ngramrl.engine import vllm_proposer

    kept = []
    lengths = vllm_proposer.NgramRLProposer._lengths

    def spy(self, drafts, exploring):
        chosen, expected, paid = lengths(self, drafts, exploring)
        kept.append((self.config.engine.adaptive_length, chosen.tolist(), np.diff(drafts.offsets).tolist()))
        return chosen, expected, paid

    monkeypatch.setattr(vllm_proposer.NgramRLProposer, "_lengths", spy)
    trace = small_trace(tmp_path / "toy.jsonl.gz")
    out = tmp_path / "steps.json"
    assert main(["bench-steps", trace, "--batch", "3", "--method", "ngramrl", "--draft-always", "--flush-mb", "0",
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["draft_always"] is True
    assert kept and all(not adaptive and chosen == sizes for adaptive, chosen, sizes in kept)
    assert any(sum(sizes) for _, _, sizes in kept)


def test_bench_steps_and_project_check_their_output_before_any_work(tmp_path, capsys):
    trace = small_trace(tmp_path / "toy.jsonl.gz")
    missing = tmp_path / "no-such-folder" / "out.json"
    assert main(["bench-steps", trace, "--batch", "4", "--json", str(missing)]) == 2
    assert f"--json '{missing}': the directory" in capsys.readouterr().err
    profile = tmp_path / "p.json"
    assert main(["profile-gpu", "--roofline", "h100", "--model", "qwen3-8b", "--out", str(profile)]) == 0
    assert main(["project", trace, "--profile", str(profile), "--engine-batch", "2", "--json", str(missing)]) == 2
    assert f"--json '{missing}': the directory" in capsys.readouterr().err
    assert main(["profile-gpu", "--roofline", "tpu", "--out", str(profile)]) == 2
    assert "--roofline 'tpu'" in capsys.readouterr().err


def no_steps(monkeypatch):
    """Fail the test if bench-steps or project starts an engine: the checks must come first."""
    import ngramrl.bench.bench_steps
    import ngramrl.bench.project

    def started(*args, **kwargs):
        raise AssertionError("an engine was built before the inputs and outputs were checked")

    for module in (ngramrl.bench.bench_steps, ngramrl.bench.project):
        monkeypatch.setattr(module, "build_engine", started)


@pytest.mark.parametrize("args, message", [
    (["bench-steps", "{trace}", "--batch", "2", "--json", "{trace}"], "--json '{trace}' is also an input"),
    (["bench-steps", "{trace}", "--batch", "2", "--profile", "{profile}", "--json", "{profile}"],
     "--json '{profile}' is also an input"),
    (["project", "{trace}", "--profile", "{profile}", "--engine-batch", "2", "--json", "{profile}"],
     "--json '{profile}' is also an input"),
    (["project", "{trace}", "--profile", "{profile}", "--engine-batch", "2", "--json", "{trace}"],
     "--json '{trace}' is also an input"),
    (["profile-gpu", "--roofline", "h100", "--model", "{model}", "--out", "{model}/config.json"],
     "--out '{model}/config.json' is also an input"),
    (["profile-gpu", "--roofline", "h100", "--model", "{model}/config.json", "--out", "{model}/config.json"],
     "--out '{model}/config.json' is also an input"),
    (["bench-steps", "{trace}", "--batch", "2", "--json", "/proc/out.json"], "--json '/proc/out.json': cannot write"),
])
def test_bench_steps_project_and_profile_gpu_never_overwrite_an_input(tmp_path, capsys, monkeypatch, args, message):
    if "/proc/" in message and not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    trace = small_trace(tmp_path / "toy.jsonl.gz")
    profile = tmp_path / "p.json"
    assert main(["profile-gpu", "--roofline", "h100", "--model", "tiny", "--out", str(profile)]) == 0
    model = tmp_path / "model"
    model.mkdir()
    config = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 512}
    (model / "config.json").write_text(json.dumps(config))
    inputs = {path: open(path, "rb").read() for path in (trace, profile, model / "config.json")}
    no_steps(monkeypatch)
    fill = lambda text: text.format(trace=trace, profile=profile, model=model)  # noqa: E731
    assert main([fill(a) for a in args]) == 2
    assert fill(message) in capsys.readouterr().err
    assert all(open(path, "rb").read() == content for path, content in inputs.items())  # untouched


@pytest.mark.parametrize("command", [["bench-steps", "--batch", "2"], ["project", "--engine-batch", "2"]])
@pytest.mark.parametrize("held, message", [("header", "nothing to replay: it holds no rollouts"),
                                           ("epoch 0", "nothing to replay: it holds epoch 0 only")])
def test_bench_steps_and_project_check_every_trace_before_any_work(tmp_path, capsys, monkeypatch, command, held,
                                                                   message):
    good = small_trace(tmp_path / "toy.jsonl.gz")
    bad = tmp_path / "bad.jsonl"
    rollouts = [] if held == "header" else [Rollout("a", 0, s, [1, 2], [10, 11, 2], "stop") for s in range(3)]
    write_trace(str(bad), TraceHeader(vocab_size=100, eos_token_ids=[2]), rollouts)
    profile = tmp_path / "p.json"
    assert main(["profile-gpu", "--roofline", "h100", "--model", "tiny", "--out", str(profile)]) == 0
    no_steps(monkeypatch)  # the good trace, first, must not run before the bad one is refused
    assert main([command[0], good, str(bad), *command[1:], "--profile", str(profile)]) == 2
    assert f"{bad}: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("k", ["0", "-1"])
def test_profile_gpu_roofline_refuses_a_k_below_one_naming_the_flag(tmp_path, capsys, k):
    out = tmp_path / "p.json"
    assert main(["profile-gpu", "--roofline", "h100", "--model", "tiny", "--k", k, "--out", str(out)]) == 2
    assert f"--k must be >= 1, got {k}" in capsys.readouterr().err
    assert not out.exists()


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
    assert data["machine"]["native_core"] == (native_module() is not None)
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


def test_project_in_several_processes_gives_the_runs_of_one_in_the_order_asked(tmp_path):
    # --cpu-scale 0: the drafting decisions do not depend on the CPU time, so the runs are the same
    trace, other = small_trace(tmp_path / "a.jsonl.gz"), small_trace(tmp_path / "b.jsonl.gz")
    profile = tmp_path / "h100.json"
    assert main(["profile-gpu", "--roofline", "h100", "--model", "qwen3-8b", "--out", str(profile)]) == 0
    results = []
    for jobs in ("1", "3"):
        out = tmp_path / f"projection-{jobs}.json"
        assert main(["project", trace, other, "--profile", str(profile), "--engine-batch", "4", "1",
                     "--method", "ngramrl", "pld", "--flush-mb", "0", "--cpu-scale", "0", "--jobs", jobs,
                     "--json", str(out)]) == 0
        results.append(json.loads(out.read_text())["runs"])
    assert results[0] == results[1]
    assert [(r["trace"], r["engine_batch"], r["method"]) for r in results[1]] == [
        (t, b, m) for t in (trace, other) for b in (4, 1) for m in ("none", "ngramrl", "pld")]
    from ngramrl.bench.project import ProjectConfig

    with pytest.raises(ValueError, match="--jobs"):
        ProjectConfig(traces=[trace], profile=str(profile), batches=[1], jobs=0)


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



def test_bench_tree_method_takes_its_width(tmp_path, capsys):
    trace = small_trace(tmp_path / "toy.jsonl")
    out = tmp_path / "tree.json"
    assert main(["bench", trace, "--method", "ngramrl-tree", "--tree-width", "2", "--json", str(out),
                 "--no-progress"]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["method"] == "ngramrl-tree" and run["tree_width"] == 2 and run["coverage"] is None
    assert main(["bench", trace, "--method", "ngramrl-tree", "--tree-width", "0", "--no-progress"]) == 2
    assert "--tree-width must be >= 1" in capsys.readouterr().err


def no_replay(monkeypatch):
    """Fail the test if a replay starts: the checks below must come before any work."""
    import ngramrl.bench.run

    def replay_started(*args, **kwargs):
        raise AssertionError("the replay ran before the outputs were checked")

    monkeypatch.setattr(ngramrl.bench.run, "run_bench", replay_started)


@pytest.mark.parametrize("flags, message", [
    (["--json", "{tmp}/no/such/dir/out.json"], "--json '{tmp}/no/such/dir/out.json': the directory"),
    (["--json", "{tmp}"], "--json '{tmp}' is a directory"),
    (["--json", "{trace}"], "--json '{trace}' is also an input"),
    (["--plot", "{trace}"], "--plot '{trace}' is also an input"),
    (["--coverage-plot", "{tmp}/toy.jsonl.gz"], "is also an input"),
    (["--json", "{tmp}/a.out", "--plot", "{tmp}/a.out"], "--plot '{tmp}/a.out' is also --json"),
    (["--json", "{tmp}/toy.jsonl.gz/x.json"], "is a file, not a directory"),
    (["--plot", "{tmp}/plot.pngx"], "--plot '{tmp}/plot.pngx': matplotlib cannot write .pngx files"),
    (["--coverage-plot", "{tmp}/cov.PNGX"], "--coverage-plot '{tmp}/cov.PNGX': matplotlib cannot write .PNGX"),
    (["--k", "100000"], "--k must be between 1 and 256"),
    (["--k", "0"], "--k must be between 1 and 256"),
])
def test_bench_refuses_bad_outputs_and_k_before_replaying(tmp_path, capsys, monkeypatch, flags, message):
    trace = small_trace(tmp_path / "toy.jsonl.gz")
    before = open(trace, "rb").read()
    no_replay(monkeypatch)
    fill = lambda text: text.format(tmp=tmp_path, trace=trace)  # noqa: E731
    assert main(["bench", trace, *map(fill, flags), "--no-progress"]) == 2
    assert fill(message) in capsys.readouterr().err
    assert open(trace, "rb").read() == before  # the input is untouched


def test_bench_plot_without_an_extension_is_the_png_savefig_writes_and_says_so(tmp_path, capsys):
    trace = small_trace(tmp_path / "toy.jsonl")
    assert main(["bench", trace, "--method", "none", "--plot", str(tmp_path / "plot."), "--no-progress"]) == 0
    assert (tmp_path / "plot.png").read_bytes().startswith(b"\x89PNG")
    assert f"wrote {tmp_path / 'plot.png'}" in capsys.readouterr().out


def test_bench_rejects_a_duplicated_rollout_naming_its_line(tmp_path, capsys):
    path = tmp_path / "dup.jsonl"
    lines = open(small_trace(tmp_path / "toy.jsonl")).read().splitlines()
    path.write_text("\n".join(lines[:5] + [lines[4]] + lines[5:]) + "\n")
    assert main(["bench", str(path), "--method", "none", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{path}:6:" in err and "appears twice (first on line 5)" in err


def test_bench_refuses_a_trace_with_nothing_to_replay(tmp_path, capsys):
    path = tmp_path / "epoch0.jsonl"
    rollouts = [Rollout("a", 0, s, [1, 2], [10, 11, 2], "stop") for s in range(3)]
    write_trace(str(path), TraceHeader(vocab_size=100, eos_token_ids=[2]), rollouts)
    assert main(["bench", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{path}: nothing to replay: it holds epoch 0 only" in err


def test_train_check_refuses_an_earlier_run_unless_told_what_to_do(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    args = ["train", "--check", "--set", f"run.output_dir={out}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"run.output_dir '{out}' holds an earlier run (metrics.jsonl); continue it with --resume" in err
    assert main(args + ["--resume"]) == 0 and "resumes the run there" in capsys.readouterr().out
    assert main(args + ["--overwrite"]) == 0
    assert "deletes the earlier run there (metrics.jsonl)" in capsys.readouterr().out
    assert (out / "metrics.jsonl").read_text() == '{"step": 0}\n'  # --check changes nothing
    assert main(args + ["--set", "run.if_exists=resume"]) == 0


@pytest.mark.parametrize("args, message", [
    (["--config", "{tmp}"], "is a directory, not a YAML config file"),
    (["--config", "{tmp}/empty.yaml"], "empty.yaml: is empty"),
    (["--set", "rollout.top_k=-7"], "top_k must be -1 or 0 (no top-k) or >= 1, got -7"),
    (["--set", "rollout.top_k=[1,"], "is not valid YAML"),
    (["--set", "run.output_dir={tmp}/empty.yaml"], "output_dir '{tmp}/empty.yaml' is a file"),
    (["--set", "model.path={tmp}"], "not a model directory (it holds no config.json"),
    (["--set", "run.output_dir={tmp}/run", "--set", "pool.restore_from={tmp}/run/pool", "--overwrite"],
     "pool.restore_from '{tmp}/run/pool' lies in run.output_dir"),
    (["--set", "run.output_dir={tmp}/run/metrics.jsonl/x"], "is a file, not a directory"),
    (["--set", "run.output_dir={tmp}/run", "--set", "model.path={tmp}/run"], "is also an input"),
    (["--resume", "--overwrite"], None),
])
def test_train_check_catches_each_case_before_anything_starts(tmp_path, capsys, args, message):
    (tmp_path / "empty.yaml").write_text("")
    (tmp_path / "run" / "pool").mkdir(parents=True)
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    (tmp_path / "run" / "config.json").write_text("{}")
    fill = lambda text: text.replace("{tmp}", str(tmp_path))  # noqa: E731
    if message is None:  # argparse: not both
        with pytest.raises(SystemExit):
            main(["train", "--check", *args])
        return
    assert main(["train", "--check", *map(fill, args)]) == 2
    assert fill(message) in capsys.readouterr().err


def test_train_check_accepts_learning_rate_in_exponent_notation(tmp_path):
    assert main(["train", "--check", "--set", "trainer.learning_rate=1e-6", "--set", f"run.output_dir={tmp_path}"]) == 0


def test_generate_checks_its_output_before_loading_anything(tmp_path, capsys, monkeypatch):
    import ngramrl.data.workloads

    monkeypatch.setattr(ngramrl.data.workloads, "load_tasks", lambda *a, **k: pytest.fail("work started"))
    assert main(["generate", "--workload", "gsm", "--out", str(tmp_path / "no" / "t.jsonl.gz")]) == 2
    assert "--out" in capsys.readouterr().err
    assert main(["generate", "--workload", "gsm", "--model", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_generate_keeps_an_existing_trace_unless_told_to_overwrite_it(tmp_path, capsys, monkeypatch):
    import ngramrl.data.workloads

    trace = tmp_path / "t.jsonl.gz"
    trace.write_bytes(b"hours of rollouts")
    monkeypatch.setattr(ngramrl.data.workloads, "load_tasks", lambda *a, **k: pytest.fail("work started"))
    assert main(["generate", "--workload", "gsm", "--out", str(trace)]) == 2
    error = capsys.readouterr().err
    assert "exists" in error and "--overwrite" in error
    assert trace.read_bytes() == b"hours of rollouts"
    monkeypatch.setattr(ngramrl.data.workloads, "load_tasks", lambda *a, **k: pytest.fail("overwrite goes on"))
    with pytest.raises(pytest.fail.Exception, match="overwrite goes on"):
        main(["generate", "--workload", "gsm", "--out", str(trace), "--overwrite"])


@pytest.mark.parametrize("args, message", [
    (["--prompts", "0"], "--prompts must be >= 1, got 0"),
    (["--prompts", "-3"], "--prompts must be >= 1, got -3"),
    (["--samples", "0"], "samples (--samples) must be >= 1, got 0"),
    (["--batch-size", "0"], "batch_size (--batch-size) must be >= 1, got 0"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--model", "/nonexistent"], "--model: path '/nonexistent' is neither a model directory"),
    (["--model", "{tmp}"], "--model: path '{tmp}' is a directory but not a model directory"),
    (["--task-settings", "[1]"], "--task-settings must be a JSON object of settings, got [1]"),
    (["--workload", "reasoning_gym", "--task", "products", "--task-settings", '{{"min_digitz": 1}}'],
     "task_settings {{'min_digitz': 1}} do not suit products"),
    (["--workload", "reasoning_gym"], "task is required for the reasoning_gym workload"),
    (["--task", "products"], "--task and --task-settings are for --workload reasoning_gym, not gsm"),
    (["--spider-dir", "{tmp}"], "--spider-dir is for --workload spider, not gsm"),
])
def test_generate_checks_its_settings_before_loading_anything(tmp_path, capsys, monkeypatch, args, message):
    import ngramrl.data.workloads

    if "reasoning_gym" in args:
        pytest.importorskip("reasoning_gym")
    monkeypatch.setattr(ngramrl.data.workloads, "load_tasks", lambda *a, **k: pytest.fail("work started"))
    fill = lambda text: text.format(tmp=tmp_path)  # noqa: E731
    workload = [] if "--workload" in args else ["--workload", "gsm"]
    assert main(["generate", *workload, *map(fill, args), "--out", str(tmp_path / "t.jsonl.gz")]) == 2
    assert fill(message) in capsys.readouterr().err


@pytest.mark.parametrize("args, flag", [
    (["generate", "--workload", "gsm", "--out", "t.jsonl.gz", "--temperature", "nan"], "--temperature"),
    (["generate", "--workload", "gsm", "--out", "t.jsonl.gz", "--top-p", "inf"], "--top-p"),
    (["bench-steps", "t.jsonl.gz", "--batch", "2", "--flush-mb", "inf"], "--flush-mb"),
    (["bench-steps", "t.jsonl.gz", "--batch", "2", "--pool-sync-wait-ms", "nan"], "--pool-sync-wait-ms"),
    (["project", "t.jsonl.gz", "--profile", "p.json", "--cpu-scale", "nan"], "--cpu-scale"),
    (["profile-gpu", "--roofline", "h100", "--out", "p.json", "--host-ms", "nan", "0"], "--host-ms"),
])
def test_number_flags_refuse_nan_and_infinity_by_name(args, flag, capsys, tmp_path, monkeypatch):
    """NaN passes every range check and infinity overflows where it is used: both are refused as
    the flags are read, naming the flag."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        main(args)
    assert stopped.value.code == 2
    assert f"argument {flag}: " in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--device", "cpu"], "--device: for measuring on a device; --roofline computes"),
    (["--quick", "--time-budget-s", "5"], "--quick, --time-budget-s: for measuring"),
])
def test_profile_gpu_refuses_flags_of_the_other_mode(args, message, tmp_path, capsys):
    out = str(tmp_path / "p.json")
    assert main(["profile-gpu", "--roofline", "h100", "--model", "tiny", "--out", out, *args]) == 2
    assert message in capsys.readouterr().err
    assert main(["profile-gpu", "--model", "tiny", "--out", out, "--efficiency", "0.8", "0.7"]) == 2
    assert "--efficiency: for --roofline" in capsys.readouterr().err
    assert not os.path.exists(out)


def test_train_names_a_garbage_snapshot_before_anything_starts(tmp_path, capsys):
    pool = tmp_path / "old" / "pool"
    pool.mkdir(parents=True)
    for index in range(2):
        (pool / f"shard-{index}.json.gz").write_bytes(b"\x00garbage")
    args = ["train", "--set", f"run.output_dir={tmp_path / 'run'}", "--set", f"pool.restore_from={pool}"]
    assert main(args) == 2  # refused before Ray or a model is touched
    assert f"{pool / 'shard-0.json.gz'}: not a readable drafter snapshot" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_bench_without_suffixdecoding_skips_it_by_default_and_refuses_it_when_asked(tmp_path, capsys, monkeypatch):
    """A missing package is found before any replay: the default set goes on without the method
    (and says so); a method asked for by name is an error before the replay starts."""
    import ngramrl.bench.run
    import ngramrl.bench.steps

    missing = lambda m: "arctic-inference (SuffixDecoding) is not installed" if m == "suffix" else None  # noqa: E731
    monkeypatch.setattr(ngramrl.bench.steps, "method_available", missing)
    monkeypatch.setattr(ngramrl.bench.run, "method_available", missing)
    trace = small_trace(tmp_path / "toy.jsonl.gz")
    out = tmp_path / "out.json"
    assert main(["bench", trace, "--json", str(out), "--no-progress"]) == 0
    assert "skipping suffix: arctic-inference (SuffixDecoding) is not installed" in capsys.readouterr().err
    assert "suffix" not in {r["method"] for r in json.loads(out.read_text())["runs"]}
    no_replay(monkeypatch)
    assert main(["bench", trace, "--method", "suffix", "--no-progress"]) == 2
    assert "method 'suffix' cannot run here: arctic-inference" in capsys.readouterr().err


def test_bench_run_objects_say_their_regime(tmp_path):
    trace = small_trace(tmp_path / "toy.jsonl.gz")
    for regime in ("epochs", "siblings"):
        out = tmp_path / f"{regime}.json"
        assert main(["bench", trace, "--regime", regime, "--method", "ngramrl", "--json", str(out),
                     "--no-progress"]) == 0
        assert [r["regime"] for r in json.loads(out.read_text())["runs"]] == [regime]


def test_bench_coverage_flags_need_the_method_they_measure(tmp_path, capsys, monkeypatch):
    trace = small_trace(tmp_path / "toy.jsonl.gz")
    no_replay(monkeypatch)
    assert main(["bench", trace, "--method", "pld", "--coverage-plot", str(tmp_path / "c.png"), "--no-progress"]) == 2
    assert "add --method ngramrl" in capsys.readouterr().err
    assert not (tmp_path / "c.png").exists()


def test_bench_oracles_replay_rollouts_of_an_empty_prompt(tmp_path):
    path = tmp_path / "empty_prompt.jsonl"
    rollouts = [Rollout("a", epoch, s, [], [10, 11, 12, 13, 2], "stop") for epoch in range(2) for s in range(2)]
    write_trace(str(path), TraceHeader(vocab_size=100, eos_token_ids=[2]), rollouts)
    out = tmp_path / "out.json"
    assert main(["bench", str(path), "--method", "oracle", "--method", "oracle-prompt", "--method", "none",
                 "--json", str(out),
                 "--no-progress"]) == 0
    runs = {r["method"]: r for r in json.loads(out.read_text())["runs"]}
    assert runs["oracle"]["forwards"] < runs["none"]["forwards"]


def test_bench_refuses_a_trace_whose_replayed_rollouts_are_all_empty(tmp_path, capsys):
    path = tmp_path / "empty_outputs.jsonl"
    rollouts = [Rollout("a", 0, 0, [1, 2], [10, 11, 2], "stop"), Rollout("a", 1, 0, [1, 2], [], "length")]
    write_trace(str(path), TraceHeader(vocab_size=100, eos_token_ids=[2]), rollouts)
    assert main(["bench", str(path), "--no-progress"]) == 2
    assert "every rollout of epoch 1 and later has an empty output" in capsys.readouterr().err


def test_outputs_given_with_a_tilde_are_written_where_they_were_checked(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    assert main(["profile-gpu", "--roofline", "h100", "--out=~/h100.json"]) == 0
    assert (home / "h100.json").exists()


def test_bench_steps_windows_move_the_same_on_a_trace_cut_from_a_long_run():
    """--windows-move keeps the epochs before the replayed one, counted from the trace's first."""
    from ngramrl.bench.bench_steps import replay_history
    from ngramrl.core.trace import Trace

    header = TraceHeader(vocab_size=100, eos_token_ids=[2])
    for first in (0, 3):
        trace = Trace(header, [Rollout("a", first + epoch, 0, [1], [5, 2], "stop") for epoch in range(3)], "t")
        assert replay_history(trace, windows_move=True).epochs_kept == 2
        assert replay_history(trace, windows_move=False).epochs_kept == HistoryConfig().epochs_kept


def test_project_replays_traces_whose_epochs_skip_one_and_whose_outputs_never_decode(tmp_path, capsys):
    """Epochs 0, 2 and 5 (no epoch 1) are projected as the replay benchmark counts them; a trace
    whose outputs are one token long decodes nothing, and its fastest step is then unknown."""
    profile = tmp_path / "p.json"
    assert main(["profile-gpu", "--roofline", "h100", "--model", "tiny", "--out", str(profile)]) == 0
    gapped, short = tmp_path / "gapped.jsonl", tmp_path / "short.jsonl"
    header = TraceHeader(vocab_size=100, eos_token_ids=[2])
    write_trace(str(gapped), header, [Rollout("a", e, s, [1, 2], [10, 11, 12, 13, 2], "stop")
                                      for e in (0, 2, 5) for s in range(2)])
    write_trace(str(short), header, [Rollout("a", e, s, [1, 2], [10], "length") for e in (0, 1) for s in range(2)])
    for trace, expected in ((gapped, 2 * 2), (short, 2)):
        out = tmp_path / f"{trace.stem}.json"
        assert main(["project", str(trace), "--profile", str(profile), "--engine-batch", "2", "--method", "ngramrl",
                     "--cpu-scale", "0", "--json", str(out)]) == 0
        data = json.loads(out.read_text())
        none = next(r for r in data["runs"] if r["method"] == "none")
        assert none["requests"] == expected and none["tokens_per_forward"] == 1.0
    assert data["profile"]["fastest_step_ms"] is None  # the short trace's steps are all prefills


def test_bench_steps_keeps_every_epoch_in_the_window_unless_told_to_move_it(tmp_path):
    """Epochs 0 and 5: five apart, more than the default window's four epochs; each sample of
    epoch 5 repeats the same sample of epoch 0, and the samples differ from each other. Without
    --windows-move the replayed epoch drafts from epoch 0; with it, once epoch 0 is evicted,
    from its own samples only."""
    import random

    from ngramrl.bench.bench_steps import replay_history

    outputs = [[random.Random(s).randrange(10, 90) for _ in range(30)] + [2] for s in range(70)]
    rollouts = [Rollout("a", e, s, [1, 2], outputs[s], "stop") for e in (0, 5) for s in range(70)]
    trace_path = tmp_path / "far.jsonl"
    write_trace(str(trace_path), TraceHeader(vocab_size=100, eos_token_ids=[2]), rollouts)
    kept = replay_history(read_trace(str(trace_path)), windows_move=False)
    assert kept.epochs_kept >= 6 and kept.rollouts_per_prompt >= 140
    assert replay_history(read_trace(str(trace_path)), windows_move=True).epochs_kept == 5
    found = {}
    for moving in (False, True):
        out = tmp_path / f"steps-{moving}.json"
        assert main(["bench-steps", str(trace_path), "--batch", "4", "--method", "ngramrl", "--draft-always",
                     "--flush-mb", "0", "--json", str(out), *(["--windows-move"] if moving else [])]) == 0
        found[moving] = json.loads(out.read_text())["runs"][0]["tokens_per_forward"]
    assert found[False] > 2.0 and found[False] > found[True]


def test_bench_steps_refuses_a_trace_whose_last_epoch_has_no_output_before_any_work(tmp_path, capsys, monkeypatch):
    good = small_trace(tmp_path / "toy.jsonl.gz")
    bad = tmp_path / "bad.jsonl"
    write_trace(str(bad), TraceHeader(vocab_size=100, eos_token_ids=[2]),
                [Rollout("a", e, 0, [1, 2], [10, 11, 2] if e < 2 else [], "stop") for e in range(3)])
    no_steps(monkeypatch)
    assert main(["bench-steps", good, str(bad), "--batch", "2"]) == 2
    assert f"{bad}: nothing to replay: bench-steps replays the last epoch (2)" in capsys.readouterr().err
