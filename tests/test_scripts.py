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


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_cluster_refuses_a_job_submitted_without_its_token(tmp_path):
    """The head as ray_cluster.sh starts it: token authentication on, the job API on loopback; a
    job submitted without the token is refused, one with it runs."""
    pytest.importorskip("ray")
    import time
    import urllib.error
    import urllib.request

    ray_bin = os.path.dirname(sys.executable)
    token_path = tmp_path / "token"
    dashboard = free_port()
    env = {**os.environ, "PATH": f"{ray_bin}:{os.environ['PATH']}", "RAY_AUTH_TOKEN_PATH": str(token_path),
           "RAY_PORT": str(free_port()), "DASHBOARD_PORT": str(dashboard), "GPUS_PER_NODE": "0",
           "HEAD_ADDR": "127.0.0.1"}
    env.pop("RAY_AUTH_MODE", None)
    import shutil
    import tempfile

    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's socket paths must stay under 108 bytes
    head = subprocess.Popen(["bash", os.path.join(ROOT, "train_scripts", "ray_cluster.sh"), "head", "--block",
                             "--num-cpus", "1", "--temp-dir", temp_dir, "--include-dashboard", "true"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{dashboard}/api/jobs/"
    try:
        deadline = time.time() + 120
        while True:  # until the job API answers (it refuses us, since we send no token)
            try:
                urllib.request.urlopen(url, timeout=2)
                status = 200
            except urllib.error.HTTPError as err:
                status = err.code
            except OSError:
                status = None
            if status is not None or time.time() > deadline:
                break
            assert head.poll() is None, head.stdout.read()
            time.sleep(1)
        assert token_path.stat().st_mode & 0o077 == 0  # readable by its owner alone
        assert status == 401, f"the job API answered {status} without a token"
        submit = [os.path.join(ray_bin, "ray"), "job", "submit", "--address", f"http://127.0.0.1:{dashboard}",
                  "--no-wait", "--", "python", "-c", "print(1)"]
        without = subprocess.run(submit, env={**env, "RAY_AUTH_MODE": "disabled"}, capture_output=True, text=True,
                                 timeout=120)
        assert without.returncode != 0
        with_token = subprocess.run(submit, env={**env, "RAY_AUTH_MODE": "token"}, capture_output=True, text=True,
                                    timeout=120)
        assert with_token.returncode == 0, with_token.stdout + with_token.stderr
    finally:
        head.terminate()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)
