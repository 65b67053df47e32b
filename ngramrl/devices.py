"""What the machine computes fast in: the dtype ``auto`` stands for, for vLLM engines
(``ngramrl.engine.rollouts.resolve_dtype``) and for ``ngramrl generate``'s transformers model."""

from __future__ import annotations


def cpu_runs_bfloat16() -> bool:
    """Whether this CPU has the instructions behind PyTorch's bfloat16 matrix kernels (AVX-512 on
    x86, BF16 on Arm). Without them bfloat16 is emulated: on an AVX2 host a 135M model decoded
    5-6x slower in bfloat16 than in float32 (docs/pipeline.md)."""
    import torch

    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return True if supported is None else bool(supported())


def resolve_dtype(dtype: str, on_cpu: bool) -> str:
    """``dtype`` as it is, or for ``auto``: bfloat16 where the device computes in it (a GPU with
    bfloat16, a CPU with ``cpu_runs_bfloat16``), else float32 on a CPU and float16 on a GPU."""
    if dtype != "auto":
        return dtype
    if on_cpu:
        return "bfloat16" if cpu_runs_bfloat16() else "float32"
    import torch

    if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        return "float16"
    return "bfloat16"
