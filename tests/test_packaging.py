"""The package as a user installs it: a wheel built from this checkout holds every subpackage and data file."""

import os
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def source_packages() -> set[str]:
    """Every directory of ngramrl that holds Python modules, as a dotted name."""
    found = set()
    for folder, dirs, files in os.walk(os.path.join(ROOT, "ngramrl")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        if any(name.endswith(".py") for name in files):
            found.add(os.path.relpath(folder, ROOT).replace(os.sep, "."))
    return found


def test_wheel_holds_every_subpackage_and_the_traces(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), ROOT], check=True, capture_output=True, text=True)
    (wheel,) = [name for name in os.listdir(tmp_path) if name.endswith(".whl")]
    names = zipfile.ZipFile(tmp_path / wheel).namelist()
    packaged = {os.path.dirname(name).replace("/", ".") for name in names if name.endswith("/__init__.py")}
    assert source_packages() - packaged == set(), "subpackages missing from the wheel"
    traces = [name for name in names if name.startswith("ngramrl/traces/") and name.endswith(".jsonl.gz")]
    assert len(traces) == len([n for n in os.listdir(os.path.join(ROOT, "ngramrl", "traces")) if n.endswith(".gz")])
    entry_points = next(name for name in names if name.endswith("entry_points.txt"))
    text = zipfile.ZipFile(tmp_path / wheel).read(entry_points).decode()
    assert "ngramrl = ngramrl.cli:main" in text and "vllm.general_plugins" in text
