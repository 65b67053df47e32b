import json

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
    methods = ("ngramrl", "ngramrl-tree", "suffix", "pld", "none", "oracle", "oracle-prompt")
    assert {(r["method"], r["k"]) for r in runs} == {(m, k) for m in methods for k in (16, 8)}
    for run in runs:
        assert run["workload"] == "toy" and run["trace"] == trace and run["rollouts"] == 8
        assert run["tokens_per_forward"] == round(run["tokens"] / run["forwards"], 4)
        assert set(run) >= {"trace", "workload", "method", "k", "rollouts", "tokens", "forwards",
                            "tokens_per_forward", "coverage", "draft_us_per_step"}
        assert ("tree_width" in run) == (run["method"] == "ngramrl-tree")
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


def test_bench_tree_method_takes_its_width(tmp_path, capsys):
    trace = small_trace(tmp_path / "toy.jsonl")
    out = tmp_path / "tree.json"
    assert main(["bench", trace, "--method", "ngramrl-tree", "--tree-width", "2", "--json", str(out),
                 "--no-progress"]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["method"] == "ngramrl-tree" and run["tree_width"] == 2 and run["coverage"] is None
    assert main(["bench", trace, "--method", "ngramrl-tree", "--tree-width", "0", "--no-progress"]) == 2
    assert "--tree-width must be >= 1" in capsys.readouterr().err
