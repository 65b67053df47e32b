"""The engine benchmark's per-phase process accounting (the benchmark itself runs real engines;
docs/vllm.md has its runs)."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("psutil")

from ngramrl.engine.benchmark import _usage_delta, process_usage  # noqa: E402

# Spins 0.3 s of CPU, says so and waits; on a line from the test, spins 0.3 s more, says so and waits.
SPIN = ("import sys, time\n"
        "for _ in range(2):\n"
        "    end = time.process_time() + 0.3\n"
        "    while time.process_time() < end: pass\n"
        "    print('spun', flush=True)\n"
        "    sys.stdin.readline()\n")


def test_a_child_process_cpu_time_is_counted_under_its_name(tmp_path):
    """A child (named "spinner") shows up under its name with the CPU it spent during the phase
    (its second 0.3 s), not what it had spent before the phase began (its first). It waits at both
    readings, so what they see does not depend on how the machine schedules it."""
    spinner = tmp_path / "spinner"
    os.symlink(os.path.realpath(sys.executable), spinner)
    child = subprocess.Popen([str(spinner), "-c", SPIN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "spun\n"
        before = process_usage()
        assert "spinner" in before

        def cpu(usage):
            return usage["spinner"]["user_s"] + usage["spinner"]["sys_s"]

        assert cpu(before) >= 0.29
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "spun\n"
        spent = _usage_delta(before, process_usage())
        assert 0.29 <= cpu(spent) <= 0.4, spent
    finally:
        child.communicate("")
