"""The launch scripts: every one parses, and the CPU one runs for real (on a tiny model)."""

import glob
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "train_scripts", "*.sh"))
                 + glob.glob(os.path.join(ROOT, "scripts", "*.sh")) + [os.path.join(ROOT, ".ci", "run")])


@pytest.mark.parametrize("path", SCRIPTS, ids=os.path.basename)
def test_script_parses(path):
    result = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_cluster_script_rejects_an_unknown_role():
    result = subprocess.run(["bash", os.path.join(ROOT, "train_scripts", "ray_cluster.sh"), "sideways"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "unknown role sideways" in result.stderr


def test_cpu_launch_script_runs(tmp_path):
    pytest.importorskip("ray")
    pytest.importorskip("deepspeed")
    pytest.importorskip("vllm")
    from tests.conftest import build_tiny_model

    model = build_tiny_model(str(tmp_path / "model"), max_positions=2048)
    out = tmp_path / "run"
    result = subprocess.run(
        ["bash", os.path.join(ROOT, "train_scripts", "train_cpu_default.sh"), "--set", f"model.path={model}",
         "--set", "run.steps=1", "--set", f"run.output_dir={out}", "--set", "workload.name=gsm",
         "--set", "workload.prompts=1", "--set", "rollout.prompts_per_step=1", "--set", "rollout.samples_per_prompt=2",
         "--set", "rollout.max_tokens=16", "--set", "rollout.max_model_len=2048", "--set", "tracking.progress=false",
         "--set", "rollout.cpu_kv_cache_gib=1"],
        capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHON": sys.executable}, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rollout time" in result.stdout
    assert len(json.loads((out / "summary.json").read_text())) == 1
