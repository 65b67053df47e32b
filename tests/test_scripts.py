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


def test_install_stops_before_anything_when_the_disk_is_too_small(tmp_path):
    venv = tmp_path / "deep" / "venv"
    # No package index: were the check to let the install through, pip fails at once instead of downloading.
    env = dict(os.environ, VENV=str(venv), MIN_FREE_GB="1e9", PYTHON=sys.executable, PIP_NO_INDEX="1")
    result = subprocess.run(["bash", os.path.join(ROOT, "scripts", "install.sh")], capture_output=True, text=True,
                            env=env, timeout=60)
    assert result.returncode != 0
    assert "not enough disk space, nothing installed" in result.stderr
    assert f"the new venv {venv}" in result.stderr and f"at {tmp_path}" in result.stderr
    assert not venv.exists()


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


def _gpu_check(tmp_path, **settings):
    pytest.importorskip("torch")
    from tests.test_cli import small_trace

    trace = small_trace(tmp_path / "toy.jsonl.gz")
    env = {**os.environ, "PYTHON": sys.executable, "MODEL": "tiny", "DEVICE": "cpu", "QUICK": "1", "TRACES": trace,
           "BATCHES": "1 2", "PROFILE_BUDGET_S": "60", "OMP_NUM_THREADS": "1", "STEP_TRACES": trace,
           "STEP_BATCHES": "2", "STEP_THREADS": "1 2", "JOBS": "2", **settings}
    env.pop("PYTHONPATH", None)  # the script runs from the checkout, ngramrl need not be installed
    out = tmp_path / "check"
    result = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), str(out)], capture_output=True,
                            text=True, timeout=600, env=env, cwd=str(tmp_path))
    return result, out


def test_gpu_check_runs_end_to_end_on_a_tiny_shape_on_the_cpu(tmp_path):
    result, out = _gpu_check(tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["bench_steps.json", "env.txt", "profile.json", "profile.log",
                                                     "progress.txt", "projection.json", "projection.txt",
                                                     "roofline.json"]
    assert "drafting core: " in (out / "env.txt").read_text()  # which one the projection's drafting times are
    steps = json.loads((out / "bench_steps.json").read_text())
    assert {(r["method"], r["threads"]) for r in steps["runs"] if r["method"].startswith("ngramrl")} == {
        ("ngramrl", 1), ("ngramrl", 2), ("ngramrl-prefetch", 1), ("ngramrl-prefetch", 2)}
    profile = json.loads((out / "profile.json").read_text())
    assert profile["source"] == "measured" and profile["model"]["name"] == "tiny"
    projection = json.loads((out / "projection.json").read_text())
    assert {(r["method"], r["engine_batch"]) for r in projection["runs"]} >= {("none", 1), ("ngramrl", 2)}
    assert "PROJECTION, not a measurement" in (out / "projection.txt").read_text()
    assert (out / "progress.txt").read_text().splitlines()[-1].startswith("gpu_check: finished")


def test_gpu_check_says_how_far_it_got_when_a_stage_runs_out_of_time(tmp_path):
    result, out = _gpu_check(tmp_path, PROJECT_BUDGET_S="1", BATCHES="1 1 1 1 1 1 1 1")
    assert result.returncode == 1
    assert "stopped during 'projection" in result.stderr and "profile.json" in result.stderr
    assert (out / "profile.json").exists()


def test_the_gpu_path_imports_only_pytorch_numpy_and_the_standard_library(tmp_path):
    # What a GPU machine with PyTorch alone has: ngramrl's measured profile and projection must
    # import nothing beyond it (SuffixDecoding's package is optional and skipped when missing).
    # PyTorch's own attention biases load its compiler stack (sympy and the like): PyTorch's
    # dependencies, there wherever it is.
    pytest.importorskip("torch")
    from tests.test_cli import small_trace

    trace = small_trace(tmp_path / "toy.jsonl.gz")
    listing = "import sys, json; print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    baseline = subprocess.run([sys.executable, "-c", "import torch, numpy, torch.nn.attention.bias; " + listing],
                              capture_output=True, text=True, check=True, cwd=ROOT)
    profile = tmp_path / "p.json"
    path = (f"from ngramrl.cli import main; "
            f"assert main(['profile-gpu', '--model', 'tiny', '--device', 'cpu', '--quick', '--out', {str(profile)!r}]) "
            f"== 0; assert main(['project', {trace!r}, '--profile', {str(profile)!r}, '--engine-batch', '2', "
            f"'--method', 'ngramrl', 'ngramrl-prefetch', 'pld', '--flush-mb', '1']) == 0; " + listing)
    used = subprocess.run([sys.executable, "-c", path], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert used.returncode == 0, used.stderr[-2000:]
    extra = (set(json.loads(used.stdout.splitlines()[-1])) - set(json.loads(baseline.stdout))
             - set(sys.stdlib_module_names))
    assert extra <= {"ngramrl"}, extra


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
        deadline = time.time() + 180
        while True:  # the job agent starts after the API answers: until then a submission is refused as early
            with_token = subprocess.run(submit, env={**env, "RAY_AUTH_MODE": "token"}, capture_output=True,
                                        text=True, timeout=120)
            if with_token.returncode == 0 or "No available agent" not in with_token.stdout + with_token.stderr \
                    or time.time() > deadline:
                break
            time.sleep(2)
        assert with_token.returncode == 0, with_token.stdout + with_token.stderr
        without = subprocess.run(submit, env={**env, "RAY_AUTH_MODE": "disabled"}, capture_output=True, text=True,
                                 timeout=120)  # the agent is up now: only the token is missing
        assert without.returncode != 0
    finally:
        head.terminate()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)


REPLAY_SCRIPTS = [
    ("coverage_gap.py", ["--budget", "4", "--candidates", "8"], ["coverage ", "designs: ", "P(j) predicted"]),
    ("drafter_choices.py", ["--k", "8", "--variant", "path_width=2", "--variant", "longest-match:"],
     ["default chain", "tree width=4", "chain path_width=2", "longest-match"]),
    ("suffix_settings.py", ["--k", "8", "--setting", "24,1.0,0.1", "--setting", "64,4.0,0.1"],
     ["suffix depth=24 factor=1 min_prob=0.1", "suffix depth=64 factor=4", "ngramrl x"]),
]


@pytest.mark.parametrize(("script", "args", "expected"), REPLAY_SCRIPTS, ids=[s for s, _, _ in REPLAY_SCRIPTS])
def test_the_replay_scripts_the_docs_cite_run_on_a_small_trace(tmp_path, script, args, expected):
    """docs/prefetch.md and docs/drafter.md give these commands for their tables: each runs
    against the replay's current interfaces and prints its rows."""
    if script == "suffix_settings.py":
        pytest.importorskip("arctic_inference")
    from ngramrl.bench.run import builtin_traces
    from ngramrl.core.trace import read_trace, write_trace

    whole = read_trace(next(p for p in builtin_traces() if "gsm-smollm2-t0.6" in p))
    prompts = sorted({r.prompt_id for r in whole.rollouts})[:2]
    small = str(tmp_path / "small.jsonl.gz")
    write_trace(small, whole.header, [r for r in whole.rollouts if r.prompt_id in prompts and r.epoch <= 1])
    result = subprocess.run([sys.executable, os.path.join("scripts", script), small, *args], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    for text in expected:
        assert text in result.stdout, (text, result.stdout[-2000:])
