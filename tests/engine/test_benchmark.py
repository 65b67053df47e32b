"""The engine benchmark's per-phase process accounting (the benchmark itself runs real engines;
docs/vllm.md has its runs)."""

import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("psutil")

from ngramrl.engine.benchmark import _usage_delta, process_usage  # noqa: E402

SPIN = "import sys, time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\nsys.stdin.read()"


def test_a_child_process_cpu_time_is_counted_under_its_name(tmp_path):
    """A child (named "spinner") that spins for half a second of CPU shows up under its name with
    that time: the delta over the phase, not what it had spent before the phase began."""
    spinner = tmp_path / "spinner"
    os.symlink(os.path.realpath(sys.executable), spinner)
    child = subprocess.Popen([str(spinner), "-c", SPIN], stdin=subprocess.PIPE)
    try:
        time.sleep(0.2)
        before = process_usage()
        assert "spinner" in before

        def cpu(usage):
            return usage["spinner"]["user_s"] + usage["spinner"]["sys_s"]

        deadline = time.monotonic() + 30
        while cpu(process_usage()) < 0.49 and time.monotonic() < deadline:  # its half second is spent
            time.sleep(0.05)
        spent = _usage_delta(before, process_usage())
        assert 0.1 <= cpu(spent) <= 0.45, spent
    finally:
        child.communicate(b"")
