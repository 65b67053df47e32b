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


def test_the_job_runtime_env_leaves_the_drivers_variables_to_it():
    """ray job submit --runtime-env ray_configs/runtime_env.yaml, then the driver's ray.init with its
    own env_vars: Ray refuses the job if both set a variable (even to the same value)."""
    import yaml

    pytest.importorskip("ray")
    from ray.runtime_env.runtime_env import _merge_runtime_env

    from ngramrl.pipeline.run import driver_runtime_env

    job = yaml.safe_load(open(os.path.join(ROOT, "ray_configs", "runtime_env.yaml")))
    assert _merge_runtime_env(job, driver_runtime_env()) is not None


def test_job_runtime_env_is_valid_yaml():
    import yaml

    with open(os.path.join(ROOT, "ray_configs", "runtime_env.yaml")) as handle:
        env = yaml.safe_load(handle)
    assert env["working_dir"] == "." and ".venv" in env["excludes"]
    assert len(TRAIN_CONFIGS) == 3


def test_defaults_and_overrides():
    config = load_config(None, ["run.steps=3", "ngramrl.prefetch.budget=4", "rollout.temperature=0.6"])
    assert (config.run.steps, config.ngramrl.prefetch.budget, config.rollout.temperature) == (3, 4, 0.6)


@pytest.mark.parametrize("text, message", [
    ("rollout:\n  samples_per_prompt: 1\n", "bad.yaml: rollout: samples_per_prompt must be >= 2"),
    ("rollout:\n  samplez: 3\n", "bad.yaml: unknown key rollout.samplez"),
    ("pool:\n  draft_timeout_ms: 20\n", "bad.yaml: pool.draft_timeout_ms is no longer a setting: engines draft"),
    ("ngramrl:\n  prefetch:\n    workers: 2\n",
     "bad.yaml: ngramrl.prefetch.workers is no longer a setting: the prefetch runs on the drafting core's threads"),
    ("pool:\n  sync_wait_ms: -1\n", "bad.yaml: pool: num_cpus_per_shard, save_every and sync_wait_ms must be >= 0"),
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
    assert main(["train", "--check", "--config", os.path.join(ROOT, "ray_configs", "cpu_default.yaml"),
                 "--set", f"run.output_dir={tmp_path / 'run'}"]) == 0


def model_dir(path):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    return str(path)


@pytest.mark.parametrize("overrides, message", [
    (["rollout.top_k=-7"], "rollout: top_k must be -1 or 0 (no top-k) or >= 1, got -7"),
    (["rollout.top_k=[1,"], "override 'rollout.top_k=[1,': the value '[1,' is not valid YAML"),
    (["rollout.temperature=[a"], "the value '[a' is not valid YAML"),
    (["=3"], "override '=3' must look like section.key=value"),
    (["run..steps=3"], "must look like section.key=value"),
    (["run.steps"], "must look like section.key=value"),
    (["run.output_dir={tmp}/a-file"], "run: output_dir '{tmp}/a-file' is a file, not a directory"),
    (["model.path={tmp}"], "model: path '{tmp}' is a directory but not a model directory (it holds no config.json"),
    (["model.path={tmp}/a-file"], "is a file; give a model directory"),
    (["model.path=models/tiny"], "path 'models/tiny': no such model directory (models/ exists here, so this is taken "
                                 "for a local path, not a Hugging Face id"),
    (["trainer.learning_rate=fast"], "trainer.learning_rate must be a number, got 'fast'"),
    (["run.if_exists=append"], "run: if_exists must be one of refuse, resume, overwrite"),
    (["model.rollout_dtype=bf16"], "rollout_dtype must be one of auto, float32, bfloat16, float16, got 'bf16'"),
    (["model.train_dtype=auto"], "train_dtype must be one of float32, bfloat16, float16, got 'auto'"),
    (["ray.num_cpus=1", "trainer.num_cpus_per_actor=2"], "ray.num_cpus (1) is less than the actors reserve ("),
])
def test_check_catches_what_would_fail_later(tmp_path, monkeypatch, overrides, message):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    fill = lambda text: text.format(tmp=tmp_path)  # noqa: E731
    with pytest.raises(ConfigError) as err:
        load_config(None, [fill(o) for o in overrides])
    assert fill(message) in str(err.value)


def test_a_local_model_directory_and_a_hub_id_are_accepted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model_dir(tmp_path / "models" / "tiny")
    assert load_config(None, ["model.path=models/tiny"]).model.path == "models/tiny"
    assert load_config(None, ["model.path=HuggingFaceTB/SmolLM2-135M-Instruct"]).model.path.startswith("Hugging")


@pytest.mark.parametrize("where", ["set", "yaml"])
def test_floats_in_exponent_notation_are_numbers(tmp_path, where):
    """PyYAML reads 1e-6 (no dot) as a string; a float field takes it as the number it means."""
    if where == "set":
        config = load_config(None, ["trainer.learning_rate=1e-6", "rollout.temperature=6E-1"])
    else:
        path = tmp_path / "c.yaml"
        path.write_text("trainer:\n  learning_rate: 1e-6\nrollout:\n  temperature: 6E-1\n")
        config = load_config(str(path))
    assert config.trainer.learning_rate == 1e-6 and config.rollout.temperature == 0.6
    with pytest.raises(ConfigError, match="run.steps must be an integer, got '1e3'"):
        load_config(None, ["run.steps=1e3"])  # not for integer fields


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n"])
def test_an_empty_config_file_is_refused(tmp_path, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="empty.yaml: is empty .*leave out --config to run the built-in defaults"):
        load_config(str(path))


def test_a_directory_as_config_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="is a directory, not a YAML config file"):
        load_config(str(tmp_path))



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
    with pytest.raises(ConfigError, match="task and task_settings are for the reasoning_gym workload"):
        load_config(None, ["workload.task=products"])
    # The default config names a task; choosing another workload with --set leaves the task behind.
    default = os.path.join(ROOT, "ray_configs", "cpu_default.yaml")
    assert load_config(default, []).workload.task == "products"
    other = load_config(default, ["workload.name=gsm"]).workload
    assert other.name == "gsm" and other.task is None and other.task_settings == {}
    with pytest.raises(ConfigError, match="task and task_settings are for the reasoning_gym workload"):
        load_config(default, ["workload.name=gsm", "workload.task=chain_sum"])


@pytest.mark.parametrize("override, expected", [("ray.num_cpus=6", 6), ("rollout.threads=3", 3),
                                                ("ngramrl.prefetch.budget=4", 4)])
def test_an_empty_section_holds_its_defaults_and_takes_overrides(tmp_path, override, expected):
    section = override.split(".")[0]
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\nrun:\n  steps: 2\n")
    assert load_config(str(path)).run.steps == 2
    config = load_config(str(path), [override])
    node = config
    for key in override.partition("=")[0].split("."):
        node = getattr(node, key)
    assert node == expected


@pytest.mark.parametrize("override, message", [
    ("rollout.num_cpus_per_engine=-1", "rollout: num_cpus_per_engine must be >= 0, got -1"),
    ("rollout.num_gpus_per_engine=-0.5", "rollout: num_gpus_per_engine must be >= 0, got -0.5"),
    ("trainer.num_cpus_per_actor=-2", "trainer: num_cpus_per_actor must be >= 0, got -2"),
    ("trainer.num_gpus_per_actor=-1", "trainer: num_gpus_per_actor must be >= 0, got -1"),
    ("rollout.threads=-1", "rollout: threads must be >= 0 (0: all of the machine's), got -1"),
    ("trainer.threads=-4", "trainer: threads must be >= 0 (0: all of the machine's), got -4"),
    ("rollout.cpu_kv_cache_gib=-1", "rollout: cpu_kv_cache_gib must be >= 1, got -1"),
    ("rollout.cpu_kv_cache_gib=0", "rollout: cpu_kv_cache_gib must be >= 1, got 0"),
    ("rollout.temperature=.nan", "rollout.temperature must be a finite number, got nan"),
    ("run.timeout_s=.NaN", "run.timeout_s must be a finite number, got nan"),
    ("run.timeout_s=.inf", "run.timeout_s must be a finite number, got inf"),
    ("trainer.learning_rate=.nan", "trainer.learning_rate must be a finite number, got nan"),
    ("rollout.temperature=2.5", "rollout: temperature must be in [0, 2], got 2.5"),
    ("rollout.top_p=0", "rollout: top_p must be in (0, 1], got 0"),
    ("workload.spider_dir=/data/spider", "workload: spider_dir is for the spider workload, not gsm"),
    ("workload.task_settings={max_digits: 2}", "workload: task and task_settings are for the reasoning_gym"),
    ("model.train_dtype=bfloat16", "model.train_dtype bfloat16 needs trainer.precision bf16"),
    ("run.save_policy_every=-1", "run: save_policy_every must be >= 0"),
])
def test_settings_that_cannot_run_are_refused(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert f"<defaults>: {message}" in str(err.value)


def test_engine_args_vllm_does_not_take_are_refused():
    pytest.importorskip("vllm")
    with pytest.raises(ConfigError, match=r"<defaults>: rollout: engine_args: max_num_seqz is not a "
                                          r"vllm.EngineArgs setting"):
        load_config(None, ["rollout.engine_args={max_num_seqz: 4, max_num_seqs: 4}"])
    assert load_config(None, ["rollout.engine_args={max_num_seqs: 4}"]).rollout.engine_args == {"max_num_seqs": 4}


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("rollout:\n  temperature: 0.8\nrun:\n  steps: 3\nrollout:\n  top_p: 0.9\n")
    with pytest.raises(ConfigError, match=r"twice.yaml: not valid YAML: key 'rollout' is given twice \(on line 1 "
                                          r"and line 5\)"):
        load_config(str(path))
    path.write_text("rollout:\n  temperature: 0.8\nrun:\n  steps: 3\n  steps: 4\n")
    with pytest.raises(ConfigError, match=r"key 'steps' is given twice \(on line 4 and line 5\)"):
        load_config(str(path))


def test_a_run_on_its_own_ray_must_find_the_gpus_it_reserves(monkeypatch, capsys, tmp_path):
    """On a machine without the GPUs a config reserves, a local Ray would wait for them until
    run.timeout_s: --check and train say so first; joining a cluster (ray.address) is not checked."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    gpu = os.path.join(ROOT, "ray_configs", "gpu_single_node.yaml")
    out = f"run.output_dir={tmp_path / 'run'}"
    assert main(["train", "--config", gpu, "--check", "--set", out]) == 2
    assert "the run reserves 8 GPUs" in capsys.readouterr().err and not (tmp_path / "run").exists()
    assert main(["train", "--config", gpu, "--check", "--set", out, "--set", "rollout.engines=2",
                 "--set", "trainer.num_actors=2"]) == 0
    assert main(["train", "--config", gpu, "--check", "--set", out, "--set", "ray.address=auto"]) == 0
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    load_config(None, []).check_local_gpus()  # a CPU run reserves none


@pytest.mark.parametrize("override", ["rollout.threads=0", "trainer.threads=0", "rollout.num_cpus_per_engine=0",
                                      "trainer.num_cpus_per_actor=0", "rollout.num_gpus_per_engine=0"])
def test_zero_threads_and_zero_cpus_are_accepted(override):
    load_config(None, [override])
