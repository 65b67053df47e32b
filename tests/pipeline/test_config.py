"""Run configurations: the shipped YAML files load; bad ones fail before Ray with file and key."""

import glob
import os

import pytest

from ngramrl.cli import main
from ngramrl.pipeline.config import ConfigError, load_config

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


TRAIN_CONFIGS = sorted(p for p in glob.glob(os.path.join(ROOT, "ray_configs", "*.yaml"))
                       if not p.endswith("runtime_env.yaml"))


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=os.path.basename)
def test_shipped_configs_load(path):
    config = load_config(path)
    assert config.run.steps >= 1
    assert config.rollout.samples_per_prompt >= 2


def test_job_runtime_env_is_valid_yaml():
    import yaml

    with open(os.path.join(ROOT, "ray_configs", "runtime_env.yaml")) as handle:
        env = yaml.safe_load(handle)
    assert env["working_dir"] == "." and all(isinstance(v, str) for v in env["env_vars"].values())
    assert len(TRAIN_CONFIGS) == 3


def test_defaults_and_overrides():
    config = load_config(None, ["run.steps=3", "ngramrl.prefetch.budget=4", "rollout.temperature=0.6"])
    assert (config.run.steps, config.ngramrl.prefetch.budget, config.rollout.temperature) == (3, 4, 0.6)


@pytest.mark.parametrize("text, message", [
    ("rollout:\n  samples_per_prompt: 1\n", "bad.yaml: rollout: samples_per_prompt must be >= 2"),
    ("rollout:\n  samplez: 3\n", "bad.yaml: unknown key rollout.samplez"),
    ("trainer:\n  zero_stage: two\n", "bad.yaml: trainer.zero_stage must be an integer"),
    ("ngramrl:\n  history:\n    rollouts_per_prompt: 0\n",
     "bad.yaml: ngramrl.history: rollouts_per_prompt must be >= 1"),
    ("workload:\n  name: spider\n", "bad.yaml: workload: spider_dir is required"),
    ("workload:\n  reward: nowhere.at_all:score\n",
     "bad.yaml: workload: reward 'nowhere.at_all:score' cannot be loaded"),
    ("model:\n  path: ./no/such/dir\n", "bad.yaml: model: path './no/such/dir' is neither"),
    ("trainer:\n  num_actors: 3\n", "bad.yaml: trainer.num_actors (3) must divide the rollouts per step (32"),
    ("- a\n- list\n", "bad.yaml: the top level must be a mapping"),
    ("rollout: [unclosed\n", "bad.yaml: not valid YAML"),
])
def test_bad_config_names_file_and_key(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert message in str(err.value).replace(str(tmp_path) + os.sep, "")


def test_cli_rejects_bad_config_before_ray(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("pool:\n  shards: 0\n")
    assert main(["train", "--config", str(path)]) == 2
    assert "pool: shards must be >= 1, got 0" in capsys.readouterr().err
    assert main(["train", "--check", "--config", os.path.join(ROOT, "ray_configs", "cpu_default.yaml")]) == 0


def test_a_reasoning_gym_workload_names_a_task_that_exists():
    from ngramrl.pipeline.config import ConfigError, load_config

    config = load_config(None, ["workload.name=reasoning_gym", "workload.task=products",
                                "workload.task_settings={min_terms: 2, max_terms: 2}"])
    assert config.workload.task_settings == {"min_terms": 2, "max_terms": 2}
    for override, message in (("workload.task=no_such_task", "is not a reasoning-gym dataset"),
                              ("workload.task_settings={min_digitz: 1}", "do not suit products")):
        with pytest.raises(ConfigError, match=message):
            load_config(None, ["workload.name=reasoning_gym", "workload.task=products", override])
    with pytest.raises(ConfigError, match="task is required"):
        load_config(None, ["workload.name=reasoning_gym"])
    with pytest.raises(ConfigError, match="task is for the reasoning_gym workload"):
        load_config(None, ["workload.task=products"])
