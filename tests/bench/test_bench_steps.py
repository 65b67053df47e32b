import pytest

from ngramrl.bench.bench_steps import BenchStepsConfig, repeat_order, summarize_repeats


def run(method: str, repeat: int, mean: float, median: float = 1.0, per_request: float = 1.0) -> dict:
    return {"trace": "t.jsonl.gz", "method": method, "batch": 4, "threads": 2, "budget": None, "max_budget": None,
            "repeat": repeat, "step_us_mean": mean, "step_us_median": median, "request_us_mean": per_request}


def test_repeats_alternate_the_order_of_the_runs():
    grid = ["a", "b", "c"]
    assert [repeat_order(grid, r) for r in range(4)] == [grid, grid[::-1], grid, grid[::-1]]


def test_each_run_is_read_against_the_first_run_of_its_own_repeat():
    # The host slows down over the benchmark: the baseline's mean step grows 100 -> 200 -> 300. The
    # other method is 1.5x the baseline in two repeats of three; the ratio of the medians (150 / 200)
    # would say 0.75x.
    runs = [run("base", 0, 100.0), run("other", 0, 150.0), run("other", 1, 100.0), run("base", 1, 200.0),
            run("base", 2, 300.0, median=2.0, per_request=3.0), run("other", 2, 450.0)]
    summary = {entry["method"]: entry for entry in summarize_repeats(runs, ("base", 2, None, None))}
    other, base = summary["other"], summary["base"]
    assert other["step_mean_ratio"] == 1.5 and base["step_mean_ratio"] == 1.0
    assert (other["step_us_mean"], other["step_us_mean_min"], other["step_us_mean_max"]) == (150.0, 100.0, 450.0)
    assert (base["step_us_median"], base["request_us_mean"], base["repeats"]) == (1.0, 1.0, 3)
    assert other["paired_with"] == {"method": "base", "threads": 2, "budget": None, "max_budget": None}


def test_repeats_must_be_at_least_one():
    with pytest.raises(ValueError, match="--repeats must be >= 1, got 0"):
        BenchStepsConfig(traces=["t.jsonl.gz"], batches=[4], repeats=0)
