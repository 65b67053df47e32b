"""ngramrl inside OpenRLHF: its vLLM engines draft from the ngramrl drafter pool.

    python -m ngramrl.openrlhf <every openrlhf.cli.train_ppo_ray argument> --ngramrl.shards 8 ...

No fork: the integration replaces the engine actor class that OpenRLHF's own
``create_vllm_engines`` instantiates with a subclass (``NgramRLRolloutActor``) that gives every
request its prompt id, feeds every finished rollout to the pool and adds ngramrl's metrics to the
``extra_logs`` OpenRLHF already logs to wandb; vLLM gets the ngramrl proposer through the engine
arguments the actor already forwards.
"""

from __future__ import annotations

SUPPORTED_OPENRLHF = ("0.11.",)
SUPPORTED_VLLM = ("0.32.",)


class UnsupportedVersion(RuntimeError):
    pass


def installed_version(package: str) -> str | None:
    from importlib import metadata

    for name in (package, f"{package}-cpu"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_versions() -> tuple[str, str]:
    """The installed OpenRLHF and vLLM versions, or a clear error naming the supported ones."""
    found = {"openrlhf": installed_version("openrlhf"), "vllm": installed_version("vllm")}
    wanted = {"openrlhf": SUPPORTED_OPENRLHF, "vllm": SUPPORTED_VLLM}
    problems = []
    for package, version in found.items():
        if version is None:
            problems.append(f"{package} is not installed")
        elif not version.startswith(wanted[package]):
            problems.append(f"{package} {version} is installed")
    if problems:
        supported = (" / ".join(v + "x" for v in SUPPORTED_OPENRLHF) + " with vLLM "
                     + " / ".join(v + "x" for v in SUPPORTED_VLLM))
        raise UnsupportedVersion(f"ngramrl's OpenRLHF integration supports OpenRLHF {supported}, but "
                                 f"{'; '.join(problems)}. Install a supported pair, or run OpenRLHF without ngramrl.")
    return found["openrlhf"], found["vllm"]  # type: ignore[return-value]
