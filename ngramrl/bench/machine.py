"""What a timing depends on besides the code: the machine a benchmark ran on.

The same build's step times differ by a third between hosts of one cloud VM type (docs/native.md),
so a result file that says which CPU, how many cores the process could use and whether the native
core ran can be compared with another machine's, or set aside.
"""

from __future__ import annotations

import os
import platform

from ngramrl.core.extension import native_module


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what ``platform`` knows, else ''."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cpus() -> int:
    """The cores this process may run on (its affinity: a container's or taskset's limit)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def machine_facts() -> dict:
    """The machine, for a benchmark's JSON: ``cpu``, ``logical_cpus``, ``usable_cpus``,
    ``native_core`` (whether the compiled core ran, or the Python reference), ``python``, ``platform``."""
    return {"cpu": cpu_model(), "logical_cpus": os.cpu_count() or 1, "usable_cpus": usable_cpus(),
            "native_core": native_module() is not None, "python": platform.python_version(),
            "platform": platform.platform()}


def machine_line(facts: dict) -> str:
    """One line for a benchmark's log: which machine its times come from."""
    core = "native core" if facts["native_core"] else "Python reference core (the native one is not built)"
    return (f"machine: {facts['cpu'] or 'unknown CPU'}, {facts['usable_cpus']} of {facts['logical_cpus']} "
            f"logical CPUs usable, {core}, Python {facts['python']}")


__all__ = ["cpu_model", "machine_facts", "machine_line", "usable_cpus"]
