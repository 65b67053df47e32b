"""The run report: a PNG and its numbers from a run's step records and its own trace."""

import json
import os

from ngramrl.bench.run import builtin_traces
from ngramrl.config import HistoryConfig
from ngramrl.pipeline.report import REPORT_JSON, write_report


def steps(n):
    return [{"step": i, "reward": 0.1 * i, "reward_std": 0.05, "tokens_per_forward": 1.0 + 0.01 * i,
             "offered_tokens_per_forward": 1.5 + 0.2 * i, "rollout_seconds": 10.0 - i} for i in range(n)]


def test_the_report_replays_the_run_trace_by_epoch(tmp_path):
    trace = next(t for t in builtin_traces() if "bfcl" in t and "0.6" in t)
    path, summary = write_report(str(tmp_path), steps(4), trace, 8, HistoryConfig())
    assert os.path.getsize(path) > 10_000  # a real picture
    written = json.loads((tmp_path / REPORT_JSON).read_text())
    methods = {series["method"]: series for series in written["replay"]}
    assert {"ngramrl", "pld"} <= set(methods)
    assert set(methods["ngramrl"]["tokens_per_forward"]) == {"1", "2", "3"}  # epoch 0 only builds history
    assert all(v > 1.0 for v in methods["ngramrl"]["tokens_per_forward"].values())
    assert summary["replay_ngramrl_over_pld"] > 1.0
    assert written["steps"][3]["reward"] == summary["steps"][3]["reward"]
    assert summary["replay_prompts"] == summary["run_prompts"] == 12  # a short trace: every prompt


def test_a_long_runs_trace_is_replayed_for_a_sample_of_its_prompts_with_all_their_epochs():
    """The replay runs at the run's end: past its token budget it takes the prompts that fit (by a
    stable hash of their ids), each with every epoch, and says how many."""
    from ngramrl.core.trace import read_trace
    from ngramrl.pipeline.report import replayed_trace

    path = next(t for t in builtin_traces() if "bfcl" in t and "0.6" in t)
    whole = read_trace(path)
    per_prompt = {}
    for r in whole.rollouts:
        per_prompt[r.prompt_id] = per_prompt.get(r.prompt_id, 0) + len(r.output)
    budget = sum(sorted(per_prompt.values())[:4])
    sampled, kept, total = replayed_trace(path, budget)
    assert total == len(per_prompt) and 1 <= kept < total
    ids = {r.prompt_id for r in sampled.rollouts}
    assert len(ids) == kept and sum(per_prompt[p] for p in ids) <= budget
    for prompt_id in ids:  # every epoch and sample of a kept prompt
        assert [r for r in sampled.rollouts if r.prompt_id == prompt_id] == [
            r for r in whole.rollouts if r.prompt_id == prompt_id]
    assert replayed_trace(path, budget)[0].rollouts == sampled.rollouts  # the same sample every time
    whole_fits, kept, total = replayed_trace(path, sum(per_prompt.values()))  # read in one pass
    assert whole_fits.rollouts == whole.rollouts and kept == total == len(per_prompt)
