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
# From OpenRLHF 0.11's own pin (vllm==0.29.0) to the latest release; the vLLM plugin checks each of
# its patches against the installed vLLM and leaves off what does not match (one logged line).
SUPPORTED_VLLM = ("0.29.", "0.30.", "0.31.", "0.32.", "0.33.")


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
                     + f"{SUPPORTED_VLLM[0]}x to {SUPPORTED_VLLM[-1]}x")
        raise UnsupportedVersion(f"ngramrl's OpenRLHF integration supports OpenRLHF {supported}, but "
                                 f"{'; '.join(problems)}. Install a supported pair, or run OpenRLHF without ngramrl.")
    return found["openrlhf"], found["vllm"]  # type: ignore[return-value]
