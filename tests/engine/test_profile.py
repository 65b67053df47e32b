"""The engine step profile's pieces that need no engine: the timing proposer, the profile a
benchmark run's fit gives, and smoothing."""

import json
import os

import pytest

from ngramrl.core.profile import StepProfile
from ngramrl.engine.profile import DRAFT_KEY, StepTimingProposer, profile_from_benchmark, smooth_linear
from ngramrl.engine.standin import StandInRunner, standin_vllm_config

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_the_timing_proposer_drafts_what_each_request_asks_and_times_steady_steps():
    proposer = StepTimingProposer(standin_vllm_config(4, max_model_len=64))
    runner = StandInRunner()
    proposer.bind_runner(runner)
    for i, wanted in enumerate((0, 2, 9)):
        runner.add(f"r{i}", None, [1, 2, 3])
        runner.requests[f"r{i}"].sampling_params.extra_args[DRAFT_KEY] = wanted
    drafts = proposer.propose([[5], [6], [7]], [4, 4, 62], None)
    assert [len(d) for d in drafts] == [0, 2, 1]  # at most k, and what the model length leaves
    proposer.propose([[5], [6], [7]], [5, 5, 63], None)
    runner.remove("r0")  # the batch changed: not a steady step
    proposer.propose([[6], [7]], [6, 64], None)
    records = proposer.stats_dict()["step_records"]
    assert [(rows, verified) for rows, verified, _, _ in records] == [(3, 3)]
    assert records[0][2] == pytest.approx((4 + 4 + 62) / 3) and records[0][3] >= 0
    assert proposer.stats_dict()["step_records"] == []  # read once


def test_a_benchmark_runs_fit_becomes_a_profile():
    path = os.path.join(ROOT, "docs", "results", "engine_gsm_sampler.json")
    profile = profile_from_benchmark(path)
    with open(path) as handle:
        fits = {run["concurrency"]: run["proposer"][-1]["cost_ms"]
                for arm in json.load(handle)["results"] if arm["method"] == "ngramrl" for run in arm["runs"]}
    assert profile.batches == sorted(fits) and profile.tokens[0] == 1 and profile.host.seconds(32) == 0.0
    fit = fits[8]
    b, t = profile.batches.index(8), profile.tokens.index(3)
    expected = fit["base"] + 8 * fit["per_request"] + 8 * 2 * fit["per_token"] + fit["per_verify"]
    assert profile.step_ms[b][t][0] == pytest.approx(expected)
    with pytest.raises(ValueError, match="no 'medusa' arm"):
        profile_from_benchmark(path, method="medusa")


def test_a_benchmark_fit_with_a_plateau_charges_only_the_draft_tokens_past_it(tmp_path):
    """A GPU engine's fit has a knee: the forward costs the same up to that many tokens."""
    fit = {"base": 5.0, "per_request": 0.01, "per_token": 0.1, "per_verify": 0.5, "knee_tokens": 64}
    path = tmp_path / "gpu_engine.json"
    path.write_text(json.dumps({"args": {"k": 8}, "results": [
        {"method": "ngramrl", "runs": [{"concurrency": 32, "proposer": [{"cost_ms": fit}]}]}]}))
    profile = profile_from_benchmark(str(path))
    by_tokens = dict(zip(profile.tokens, (row[0] for row in profile.step_ms[0]), strict=True))
    assert by_tokens[2] == pytest.approx(5.0 + 0.32 + 0.5)                 # 32 + 32 tokens: inside the plateau
    assert by_tokens[3] == pytest.approx(5.0 + 0.32 + 0.1 * 32 + 0.5)      # 96 tokens: 32 past it


def test_smoothing_recovers_a_linear_table_from_noisy_entries():
    batches, tokens = [1, 4, 16], [1, 2, 5]

    def truth(b, q):
        return 30 + 2 * b + 1.5 * b * (q - 1) + 3 * (q > 1)

    noise = [1.05, 0.95, 1.02, 0.97, 1.04, 0.96, 1.03, 0.98, 1.0]
    table = [[[truth(b, q) * noise[3 * i + j]] for j, q in enumerate(tokens)] for i, b in enumerate(batches)]
    profile = StepProfile(source="engine", model={"name": "m"}, device={"name": "cpu"}, k=4, batches=batches,
                          tokens=tokens, contexts=[100], step_ms=table)
    smoothed = smooth_linear(profile)
    worst_raw = max(abs(table[i][j][0] / truth(b, q) - 1) for i, b in enumerate(batches) for j, q in enumerate(tokens))
    worst = max(abs(smoothed.step_ms[i][j][0] / truth(b, q) - 1) for i, b in enumerate(batches)
                for j, q in enumerate(tokens))
    assert worst < worst_raw / 2


@pytest.mark.parametrize("flag", ["--smooth-only", "--from-benchmark"])
def test_the_profile_tool_refuses_to_write_over_its_input(tmp_path, monkeypatch, flag):
    from ngramrl.engine import profile
    from ngramrl.paths import OutputPathError

    source = tmp_path / "in.json"
    source.write_text("{}")
    monkeypatch.setattr("sys.argv", ["profile", flag, str(source), "--out", str(source)])
    with pytest.raises(OutputPathError, match="is also an input"):
        profile.main()
    assert source.read_text() == "{}"
