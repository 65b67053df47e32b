"""The run directory: an earlier run is refused, resumed or overwritten, never lost by accident."""

import json

import pytest

from ngramrl.config import NgramRLConfig
from ngramrl.core.trace import Rollout, TraceHeader, write_trace
from ngramrl.pipeline.config import ConfigError, load_config
from ngramrl.pipeline.pool import DrafterShard, SnapshotError
from ngramrl.pipeline.rundir import plan_run_dir


def earlier_run(out):
    """What a 3-step run leaves: prompt a trained in steps 0 and 2, b in step 1."""
    out.mkdir()
    rollouts = [Rollout("a", 0, s, [1], [5, 2], policy_version=0) for s in range(2)]
    rollouts += [Rollout("b", 0, s, [3], [6, 2], policy_version=1) for s in range(2)]
    rollouts += [Rollout("a", 1, s, [1], [7, 2], policy_version=2) for s in range(2)]
    write_trace(str(out / "rollouts.jsonl.gz"), TraceHeader(vocab_size=10, eos_token_ids=[2]), rollouts)
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward": 0.5}) + "\n" for s in range(3)))
    (out / "summary.json").write_text(json.dumps([{"step": s} for s in range(3)]))
    (out / "config.json").write_text("{}")
    for index in range(2):  # the default pool.shards
        DrafterShard(index, NgramRLConfig(), shards=2).save(str(out / "pool" / f"shard-{index}.json.gz"))
    (out / "policy").mkdir()  # the policy it saved after its last step
    (out / "policy" / "ngramrl_policy.json").write_text(json.dumps({"steps": 3}))
    (out / "notes.txt").write_text("mine")
    return out


def plan(out, *overrides):
    return plan_run_dir(load_config(None, [f"run.output_dir={out}", *overrides]))


def test_an_earlier_run_is_refused_and_left_alone(tmp_path):
    out = earlier_run(tmp_path / "run")
    with pytest.raises(ConfigError, match="holds an earlier run .*config.json, metrics.jsonl, summary.json"):
        plan(out)
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3


def test_overwrite_deletes_the_earlier_runs_files_only(tmp_path):
    out = earlier_run(tmp_path / "run")
    for name in ("report.png", "report.json", "config-resume-1.json"):  # its report, a resumption's config
        (out / name).write_text("{}")
    (out / "policy.saving").mkdir()  # a policy save cut short
    overwrite = plan(out, "run.if_exists=overwrite")
    earlier = overwrite.prepare()
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert overwrite.config_file() == str(out / "config.json")
    assert earlier.next_step == 0 and earlier.next_epoch == {} and earlier.rollout_count == 0
    assert earlier.trace_whole_bytes is None


def test_overwrite_refuses_a_model_among_what_it_would_delete(tmp_path):
    """model.path at an earlier run's saved policy: --overwrite would delete the model the run is
    about to load (and the earlier run's training with it)."""
    out = earlier_run(tmp_path / "run")
    (out / "policy" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="model.path .* lies in policy of run.output_dir .* --overwrite deletes"):
        plan(out, "run.if_exists=overwrite", f"model.path={out / 'policy'}")
    assert (out / "policy" / "config.json").exists()
    (out / "models" / "base").mkdir(parents=True)  # a model kept in the directory, not a run's file
    (out / "models" / "base" / "config.json").write_text("{}")
    assert plan(out, "run.if_exists=overwrite", f"model.path={out / 'models' / 'base'}").mode == "overwrite"


def test_resume_continues_steps_and_each_prompts_epochs(tmp_path):
    out = earlier_run(tmp_path / "run")
    resumed = plan(out, "run.if_exists=resume")
    earlier = resumed.prepare()
    assert earlier.next_step == 3
    assert earlier.next_epoch == {"a": 2, "b": 1}
    assert earlier.rollout_count == 6 and earlier.last_epoch == 1 and len(earlier.records) == 3
    assert earlier.trace_whole_bytes == (out / "rollouts.jsonl.gz").stat().st_size
    assert earlier.pool_dir == str(out / "pool")
    assert earlier.policy_dir == str(out / "policy") and earlier.policy_steps == 3
    assert resumed.config_file() == str(out / "config-resume-1.json")
    (out / "config-resume-1.json").write_text("{}")
    assert resumed.config_file() == str(out / "config-resume-2.json")
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["rollouts.jsonl.gz", "metrics.jsonl", "summary.json", "config.json", "config-resume-1.json", "pool",
         "policy", "notes.txt"])  # nothing deleted


def test_a_metrics_line_torn_by_a_stopped_run_is_cut_at_resume(tmp_path):
    """A run stopped while appending to metrics.jsonl leaves a last line without its newline: the
    resume reads the complete lines, and the resumed run's tracker cuts the fragment before its
    first record (which would join it)."""
    from ngramrl.pipeline.config import TrackingSection
    from ngramrl.pipeline.tracking import Tracker

    out = earlier_run(tmp_path / "run")
    with open(out / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 3, "rew')
    assert plan(out, "run.if_exists=resume").prepare().next_step == 3
    tracker = Tracker(TrackingSection(wandb="disabled"), {}, str(out), append=True)
    tracker.log(3, {"reward": 0.7})
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2, 3]
    (out / "metrics.jsonl").write_text((out / "metrics.jsonl").read_text() + "not json\n")
    with pytest.raises(ConfigError, match="metrics.jsonl:5: not a metrics record"):
        plan(out, "run.if_exists=resume")  # a complete line that is no record is damage, not a torn write


def test_resume_into_an_empty_directory_is_a_new_run(tmp_path):
    resumed = plan(tmp_path, "run.if_exists=resume")
    assert resumed.mode == "new" and resumed.prepare().next_step == 0


@pytest.mark.parametrize("damaged, content, message", [
    ("metrics.jsonl", '{"step": 0}\nnot json\n', r"metrics.jsonl:2: not a metrics record"),
    ("rollouts.jsonl.gz", "garbage", r"rollouts.jsonl.gz"),
    ("policy/ngramrl_policy.json", "{}", r"ngramrl_policy.json: cannot be read to resume the run"),
])
def test_a_damaged_earlier_run_is_reported_by_the_plan_that_check_makes(tmp_path, damaged, content, message):
    out = earlier_run(tmp_path / "run")
    (out / damaged).write_text(content)
    with pytest.raises((ConfigError, ValueError), match=message):
        plan(out, "run.if_exists=resume")  # what `ngramrl train --check` runs


@pytest.mark.parametrize("damage, message", [
    (lambda pool: (pool / "shard-1.json.gz").write_bytes(b"garbage"), "shard-1.json.gz: not a readable drafter snap"),
    (lambda pool: (pool / "shard-1.json.gz").unlink(), "shard-1.json.gz: no saved drafter shard 1"),
    (lambda pool: (pool / "shard-0.json.gz").rename(pool / "shard-2.json.gz"), "a snapshot of a pool of more shards"),
    (lambda pool: (pool / "shard-0.json.gz").write_bytes((pool / "shard-1.json.gz").read_bytes()),
     "shard-0.json.gz: holds shard 1 of a pool of 2 shards"),
])
def test_the_snapshots_a_run_restores_are_checked_before_anything_starts(tmp_path, damage, message):
    out = earlier_run(tmp_path / "run")
    damage(out / "pool")
    with pytest.raises((SnapshotError, FileNotFoundError), match=message):
        plan(out, "run.if_exists=resume")
    with pytest.raises((SnapshotError, FileNotFoundError), match=message):
        plan(tmp_path / "other", f"pool.restore_from={out / 'pool'}")
    plan(out, "run.if_exists=resume", "rollout.draft=none")  # nothing to restore: not checked


def test_a_model_that_does_not_load_costs_an_overwritten_run_nothing(tmp_path, monkeypatch):
    from ngramrl.pipeline.run import train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = earlier_run(tmp_path / "run")
    before = sorted(p.name for p in out.iterdir())
    model = tmp_path / "broken-model"  # a model directory whose tokenizer is missing
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    config = load_config(None, [f"run.output_dir={out}", "run.if_exists=overwrite", f"model.path={model}"])
    with pytest.raises(ConfigError, match="model.path .*broken-model.*cannot load its tokenizer"):
        train(config)
    assert sorted(p.name for p in out.iterdir()) == before
    assert (out / "config.json").read_text() == "{}"


def test_a_trace_torn_in_an_append_resumes_from_its_whole_part(tmp_path):
    """A run stopped while it appended a step's rollouts leaves half a gzip member: the resumed
    run reads the whole part (its steps and epochs) and its writer appends after it."""
    import gzip

    out = earlier_run(tmp_path / "run")
    trace = out / "rollouts.jsonl.gz"
    whole = trace.stat().st_size
    with open(trace, "ab") as handle:
        handle.write(gzip.compress(b'{"prompt_id": "b", "epoch": 1, "sample": 0, "prompt": [3], "output": [6]}\n')[:20])
    earlier = plan(out, "run.if_exists=resume").prepare()
    assert earlier.rollout_count == 6 and earlier.trace_whole_bytes == whole
    assert earlier.next_epoch == {"a": 2, "b": 1}


def test_a_resume_that_would_sample_other_prompts_or_otherwise_is_refused_before_anything_starts(tmp_path):
    """The resumed run's rollouts join the earlier run's trace and history under the same prompt
    ids: the settings that decide the prompts and how they are sampled must be that run's (the
    last resumption's, where there was one); the others (steps, learning rate, ...) may change."""
    out = earlier_run(tmp_path / "run")
    made = load_config(None, [f"run.output_dir={out}", "rollout.temperature=0.8", "workload.seed=3"]).to_dict()
    (out / "config.json").write_text(json.dumps(made))
    assert plan(out, "run.if_exists=resume", "rollout.temperature=0.8", "workload.seed=3", "run.steps=50",
                "trainer.learning_rate=1e-5").mode == "resume"
    with pytest.raises(ConfigError, match=r"made with rollout.temperature = 0.8 \(.*config.json\); this run's "
                                          r"rollout.temperature is 1.0"):
        plan(out, "run.if_exists=resume", "rollout.temperature=1.0", "workload.seed=3")
    with pytest.raises(ConfigError, match="made with workload.seed = 3"):
        plan(out, "run.if_exists=resume", "rollout.temperature=0.8")
    made["rollout"]["temperature"] = 1.0  # a resumption that changed it (before this check) rules now
    (out / "config-resume-1.json").write_text(json.dumps(made))
    assert plan(out, "run.if_exists=resume", "rollout.temperature=1.0", "workload.seed=3").mode == "resume"


def test_a_resume_whose_model_makes_other_prompts_or_tokens_is_refused(tmp_path):
    """Prompt ids that name other tokens now (another tokenizer, chat template or task settings)
    would make the trace unreadable; another vocabulary or end-of-sequence id, a trace whose
    header says how none of the new rollouts were sampled."""
    from ngramrl.pipeline.rundir import check_same_prompts, read_earlier_run

    out = earlier_run(tmp_path / "run")
    earlier = read_earlier_run(str(out))
    check_same_prompts(earlier, {"a": [1], "b": [3], "c": [4, 4]}, 10, [2], str(out))  # c is new: fine
    with pytest.raises(ConfigError, match="prompt 'b' is not the prompt of that id in .*rollouts.jsonl.gz"):
        check_same_prompts(earlier, {"a": [1], "b": [3, 3]}, 10, [2], str(out))
    with pytest.raises(ConfigError, match=r"vocabulary of 10 tokens and end-of-sequence ids \[2\]; .* has 12 and"):
        check_same_prompts(earlier, {"a": [1]}, 12, [2], str(out))
    with pytest.raises(ConfigError, match=r"has 10 and \[0\]"):
        check_same_prompts(earlier, {"a": [1]}, 10, [0], str(out))
