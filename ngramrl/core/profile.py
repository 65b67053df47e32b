"""Step-cost profiles: what one engine step costs on a given device for a given model.

A profile is a table of decode-step times over a grid of batch size (requests in the step),
tokens per request (1 for a plain decode step, 1 + d when d draft tokens of each request are
verified) and context length, plus the cost of prefill tokens and the host's (CPU) work per step
that a synchronous scheduler puts between forwards. It comes from one of three places:

- ``roofline_profile``: from a GPU's specifications (peak bf16 FLOP/s, memory bandwidth) and the
  model's shape, each part of the step bounded by what it must read or compute;
- ``ngramrl.bench.gpu_profile.measure_profile``: forward steps timed with PyTorch on the device
  present;
- ``ngramrl.engine.profile``: a real vLLM engine's steps as its proposer sees them.

``StepProfile.forward_seconds`` interpolates the table (piecewise linear in each dimension,
linear beyond its upper ends), which is what ``ngramrl project`` charges per simulated step. The
profile also carries the table fitted in the step-cost model's own terms (``cost_form``), so a
profile and the engine's online fit can be read side by side. The JSON format is documented in
docs/bench-contract.md.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

PROFILE_VERSION = 1
BYTES_BF16 = 2


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    """A finite JSON number (JSON as Python reads it also has NaN and Infinity)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class ModelShape:
    """What sets a dense decoder-only transformer's step cost: its dimensions."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False
    qk_norm: bool = False          # per-head RMSNorm of queries and keys (Qwen3)
    qkv_bias: bool = False         # biases on the query, key and value projections (Qwen2)
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab"):
            if getattr(self, key) < 1:
                raise ValueError(f"model shape {self.name!r}: {key} must be >= 1, got {getattr(self, key)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"model shape {self.name!r}: heads ({self.heads}) must be a multiple of kv_heads "
                             f"({self.kv_heads})")

    @property
    def linear_params(self) -> int:
        """Weights every step reads whole: the projections, the MLP and the output head (the
        embedding table is only gathered, a row per token)."""
        attention = (self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
                     + self.heads * self.head_dim * self.hidden)
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attention + mlp) + self.hidden * self.vocab

    @property
    def params(self) -> int:
        return self.linear_params + (0 if self.tied_embeddings else self.hidden * self.vocab)

    @property
    def kv_bytes_per_token(self) -> int:
        """Key and value bytes one token of context holds in the cache (bf16)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * BYTES_BF16

    @classmethod
    def from_hf_config(cls, config: Any, name: str, where: str | None = None) -> ModelShape:
        """From a Hugging Face ``config.json`` of a dense decoder (Llama, Qwen2, Qwen3, Mistral, ...);
        its errors name ``where`` (default: ``name``)."""
        where = where or name
        if not isinstance(config, dict):
            raise ValueError(f"{where}: not a model configuration (a JSON object), got {type(config).__name__}")
        text = config.get("text_config", config)
        if not isinstance(text, dict):
            raise ValueError(f"{where}: text_config must be a JSON object, got {text!r}")
        rope = text.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ValueError(f"{where}: rope_parameters must be a JSON object, got {rope!r}")
        for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
            if key not in text:
                raise ValueError(f"{where}: not a dense decoder configuration, no {key!r}")
        experts = [key for key in ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
                   if text.get(key)]
        if experts:  # the shape would count one expert's MLP as the whole model's
            raise ValueError(f"{where}: a mixture-of-experts configuration ({', '.join(experts)}); the step "
                             f"profile models dense decoders only")

        def integer(key: str, default: int | None = None) -> int:
            value = text.get(key)
            if value is None and default is not None:  # null in a config means "the default"
                return default
            if not _is_int(value) or value < 1:
                raise ValueError(f"{where}: {key} must be an integer >= 1, got {value!r}")
            return value

        def number(key: str, value: Any) -> float:
            if not _is_real(value) or value <= 0:
                raise ValueError(f"{where}: {key} must be a number > 0, got {value!r}")
            return float(value)

        def flag(key: str, default: bool) -> bool:
            value = text.get(key)
            if value is None:
                return default
            if not isinstance(value, bool):
                raise ValueError(f"{where}: {key} must be true or false, got {value!r}")
            return value

        heads, hidden = integer("num_attention_heads"), integer("hidden_size")
        model_type = str(text.get("model_type", ""))
        try:
            return cls(name=name, layers=integer("num_hidden_layers"), hidden=hidden, heads=heads,
                       kv_heads=integer("num_key_value_heads", heads), head_dim=integer("head_dim", hidden // heads),
                       intermediate=integer("intermediate_size"), vocab=integer("vocab_size"),
                       tied_embeddings=flag("tie_word_embeddings", False), qk_norm=model_type.startswith("qwen3"),
                       qkv_bias=flag("attention_bias", model_type == "qwen2"),
                       rope_theta=number("rope_theta", text.get("rope_theta") or rope.get("rope_theta", 10000.0)),
                       rms_eps=number("rms_norm_eps", 1e-6 if text.get("rms_norm_eps") is None
                                      else text["rms_norm_eps"]))
        except ValueError as err:
            if str(err).startswith(f"{where}:"):
                raise
            raise ValueError(f"{where}: {err}") from None


MODEL_SHAPES = {shape.name: shape for shape in (
    ModelShape("qwen3-8b", layers=36, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=12288,
               vocab=151936, qk_norm=True, rope_theta=1e6),
    ModelShape("qwen3-1.7b", layers=28, hidden=2048, heads=16, kv_heads=8, head_dim=128, intermediate=6144,
               vocab=151936, tied_embeddings=True, qk_norm=True, rope_theta=1e6),
    ModelShape("qwen3-32b", layers=64, hidden=5120, heads=64, kv_heads=8, head_dim=128, intermediate=25600,
               vocab=151936, qk_norm=True, rope_theta=1e6),
    ModelShape("llama-3.1-8b", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336,
               vocab=128256, rope_theta=5e5, rms_eps=1e-5),
    ModelShape("qwen2.5-7b", layers=28, hidden=3584, heads=28, kv_heads=4, head_dim=128, intermediate=18944,
               vocab=152064, qkv_bias=True, rope_theta=1e6),
    ModelShape("smollm2-135m", layers=30, hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536,
               vocab=49152, tied_embeddings=True, rope_theta=1e5, rms_eps=1e-5),
    ModelShape("tiny", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512,
               qk_norm=True),  # for tests: anything runs it in a moment
)}


def model_config_path(name_or_path: str) -> str | None:
    """The ``config.json`` that ``model_shape`` reads for ``name_or_path`` (None: a named shape)."""
    if name_or_path in MODEL_SHAPES:
        return None
    return os.path.join(name_or_path, "config.json") if os.path.isdir(name_or_path) else name_or_path


def model_shape(name_or_path: str) -> ModelShape:
    """A named shape (``MODEL_SHAPES``) or a Hugging Face ``config.json`` (or a directory holding one)."""
    path = model_config_path(name_or_path)
    if path is None:
        return MODEL_SHAPES[name_or_path]
    if not os.path.exists(path):
        raise ValueError(f"--model {name_or_path!r}: neither a known shape ({', '.join(MODEL_SHAPES)}) nor a "
                         "config.json")
    config = _read_json(path)
    return ModelShape.from_hf_config(config, os.path.basename(os.path.dirname(os.path.abspath(path))) or path, path)


def _read_json(path: str) -> Any:
    """A JSON file's content; a ValueError naming the file if it cannot be read or is not JSON."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON ({err})") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: cannot read file (not UTF-8 text: {err.reason} at byte {err.start})") from None
    except OSError as err:
        raise ValueError(f"{path}: cannot read file ({err.strerror or err})") from None


@dataclass(frozen=True)
class GPUSpec:
    """Dense bf16 tensor throughput, memory bandwidth and memory of one GPU (vendor data sheets)."""

    name: str
    bf16_tflops: float
    bandwidth_tbs: float
    memory_gib: float


GPU_SPECS = {spec.name: spec for spec in (
    GPUSpec("h100", bf16_tflops=989.0, bandwidth_tbs=3.35, memory_gib=80),   # H100 SXM5
    GPUSpec("h200", bf16_tflops=989.0, bandwidth_tbs=4.8, memory_gib=141),
    GPUSpec("a100", bf16_tflops=312.0, bandwidth_tbs=2.039, memory_gib=80),  # A100 SXM4 80 GB
    GPUSpec("l40s", bf16_tflops=362.0, bandwidth_tbs=0.864, memory_gib=48),
)}


@dataclass
class HostOverhead:
    """CPU work per engine step outside the forward (scheduling, input preparation, output
    processing). A synchronous scheduler (vLLM's, with n-gram-style drafters) runs it between
    forwards; an asynchronous one overlaps it with the previous forward. Engine-dependent: the
    defaults (0.8 ms at 100 requests) are an assumption for vLLM on a current server CPU, in line
    with the few percent of an 8B-class step that asynchronous scheduling is reported to save, not
    a measurement; profiles measured inside an engine include it in their step times and set it
    to zero (docs/gpu.md)."""

    base_ms: float = 0.5
    per_request_ms: float = 0.003

    def __post_init__(self) -> None:
        if self.base_ms < 0 or self.per_request_ms < 0:
            raise ValueError("host overhead must be >= 0")

    def seconds(self, requests: int) -> float:
        return (self.base_ms + self.per_request_ms * requests) / 1000.0


@dataclass
class RooflineSettings:
    """How close real kernels come to the data sheet: fractions of peak bandwidth and FLOP/s, and a
    fixed per-step cost on the device (graph launch, sampling, synchronisation)."""

    memory_efficiency: float = 0.85
    flop_efficiency: float = 0.7
    step_overhead_ms: float = 0.15

    def __post_init__(self) -> None:
        for key in ("memory_efficiency", "flop_efficiency"):
            if not 0.0 < getattr(self, key) <= 1.0:
                raise ValueError(f"{key} must be in (0, 1], got {getattr(self, key)}")
        if self.step_overhead_ms < 0:
            raise ValueError("step_overhead_ms must be >= 0")


DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
DEFAULT_CONTEXTS = (256, 1024, 4096)


def default_tokens(k: int) -> tuple[int, ...]:
    """Tokens per request measured for drafts of up to k tokens: 1, 2, 3, then halfway, then k + 1."""
    points = {1, 2, 3, k + 1, (k + 2) // 2 + 1}
    return tuple(sorted(p for p in points if 1 <= p <= k + 1))


def roofline_seconds(shape: ModelShape, spec: GPUSpec, settings: RooflineSettings, requests: int,
                     tokens_per_request: float, context: float, prefill_tokens: int = 0) -> float:
    """One step from the roofline: each part of it takes the longer of reading its bytes and
    computing its FLOPs. The weights are read once per step; every token multiplies them; the
    cached keys and values of each request are read once; elementwise work reads and writes the
    activations."""
    bandwidth = spec.bandwidth_tbs * 1e12 * settings.memory_efficiency
    flops = spec.bf16_tflops * 1e12 * settings.flop_efficiency
    decode = requests * tokens_per_request
    tokens = decode + prefill_tokens
    linear = max(shape.linear_params * BYTES_BF16 / bandwidth, 2.0 * shape.linear_params * tokens / flops)
    kv_read = requests * (context + tokens_per_request) * shape.kv_bytes_per_token
    per_query = 4.0 * shape.layers * shape.heads * shape.head_dim  # QK^T and PV, per context token
    attention_flops = per_query * (decode * (context + tokens_per_request / 2) + prefill_tokens * prefill_tokens / 2)
    attention = max(kv_read / bandwidth, attention_flops / flops)
    activations = tokens * shape.layers * (8 * shape.hidden + 3 * shape.intermediate) * BYTES_BF16 / bandwidth
    return settings.step_overhead_ms / 1000.0 + linear + attention + activations


def weight_read_seconds(shape: ModelShape, spec: GPUSpec) -> float:
    """The floor under any step: reading the weights once at the data sheet's bandwidth."""
    return shape.linear_params * BYTES_BF16 / (spec.bandwidth_tbs * 1e12)


def _interpolate(points: list[float], value: float) -> tuple[int, int, float]:
    """Neighbours i, j of value among sorted points and the weight of j: linear inside, linear
    extrapolation above the last point, clamped below the first."""
    if len(points) == 1 or value <= points[0]:
        return 0, 0, 0.0
    j = min(bisect.bisect_left(points, value), len(points) - 1)
    if j == 0:
        return 0, 0, 0.0
    i = j - 1
    return i, j, (value - points[i]) / (points[j] - points[i])


@dataclass
class StepProfile:
    source: str                                   # "roofline", "measured" or "engine"
    model: dict[str, Any]
    device: dict[str, Any]
    k: int
    batches: list[int]
    tokens: list[int]                             # tokens per request
    contexts: list[int]
    step_ms: list[list[list[float]]]              # [batch][tokens][context]
    measured: list[list[list[bool]]] | None = None  # which entries were measured (None: all computed)
    prefill_ms_per_token: float = 0.0
    host: HostOverhead = field(default_factory=HostOverhead)
    floor_ms: float | None = None                 # weights read once at peak bandwidth, where known
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.source not in ("roofline", "measured", "engine"):
            raise ValueError(f"profile source must be roofline, measured or engine, got {self.source!r}")
        for name in ("batches", "tokens", "contexts"):
            values = getattr(self, name)
            if not values or any(v < (0 if name == "contexts" else 1) for v in values) or values != sorted(set(values)):
                raise ValueError(f"profile {name} must be increasing positive integers, got {values}")
        if self.tokens[0] != 1:
            raise ValueError("profile tokens per request must start at 1 (a step without drafts)")
        shape = (len(self.batches), len(self.tokens), len(self.contexts))
        if (len(self.step_ms) != shape[0] or any(len(row) != shape[1] for row in self.step_ms)
                or any(len(cell) != shape[2] for row in self.step_ms for cell in row)):
            raise ValueError(f"profile step_ms must be a {shape[0]} x {shape[1]} x {shape[2]} table")
        if any(not (v > 0 and math.isfinite(v)) for row in self.step_ms for cell in row for v in cell):
            raise ValueError("profile step times must be positive")
        if self.prefill_ms_per_token < 0:
            raise ValueError("prefill_ms_per_token must be >= 0")

    def forward_seconds(self, requests: int, tokens: int, context: float, prefill_tokens: int = 0) -> float:
        """One step's forward (and sampling) with ``requests`` rows processing ``tokens`` tokens in
        all (one per row plus the draft tokens verified), at a mean context of ``context``, plus
        ``prefill_tokens`` prompt tokens of requests that join in this step. A step reads the
        weights whatever it computes: one of prefills alone costs at least a one-request step."""
        if requests <= 0:
            requests, tokens = 1, 1
        per_request = tokens / requests
        bi, bj, bw = _interpolate(self.batches, requests)
        ti, tj, tw = _interpolate(self.tokens, per_request)
        ci, cj, cw = _interpolate(self.contexts, context)
        total = 0.0
        for b, wb in ((bi, 1 - bw), (bj, bw)):
            for t, wt in ((ti, 1 - tw), (tj, tw)):
                for c, wc in ((ci, 1 - cw), (cj, cw)):
                    total += wb * wt * wc * self.step_ms[b][t][c]
        floor = self.step_ms[0][0][0] * 0.5  # linear extrapolation never below half the lightest step
        return max(total, floor) / 1000.0 + self.prefill_ms_per_token * prefill_tokens / 1000.0

    def cost_form(self) -> list[dict[str, Any]]:
        """The table in the step-cost model's terms (``ngramrl.core.cost``), per batch size and
        context: the step without drafts, what each draft token adds once the step is past its
        memory-bound plateau, and how many draft tokens the plateau holds (verified for free)."""
        from ngramrl.core.cost import fit_plateau

        rows = []
        for b, batch in enumerate(self.batches):
            for c, context in enumerate(self.contexts):
                points = [(batch * (q - 1), self.step_ms[b][t][c] / 1000.0) for t, q in enumerate(self.tokens)]
                base, per_token, free = fit_plateau(points)
                rows.append({"batch": batch, "context": context, "step_ms": round(self.step_ms[b][0][c], 4),
                             "per_draft_token_us": round(per_token * 1e6, 3), "free_draft_tokens": round(free, 1)})
        return rows

    def to_json(self) -> dict[str, Any]:
        steps = []
        for b, batch in enumerate(self.batches):
            for t, tokens in enumerate(self.tokens):
                for c, context in enumerate(self.contexts):
                    entry = {"batch": batch, "tokens_per_request": tokens, "context": context,
                             "ms": round(self.step_ms[b][t][c], 5)}
                    if self.measured is not None:
                        entry["measured"] = self.measured[b][t][c]
                    steps.append(entry)
        return {"ngramrl_step_profile": PROFILE_VERSION, "source": self.source, "model": self.model,
                "device": self.device, "k": self.k,
                "grid": {"batch": self.batches, "tokens_per_request": self.tokens, "context": self.contexts},
                "steps": steps, "prefill_ms_per_token": round(self.prefill_ms_per_token, 6),
                "host": asdict(self.host), "floor_ms": None if self.floor_ms is None else round(self.floor_ms, 4),
                "cost_form": self.cost_form(), "notes": self.notes}

    @classmethod
    def from_json(cls, data: Any, where: str = "profile") -> StepProfile:
        if not isinstance(data, dict) or data.get("ngramrl_step_profile") != PROFILE_VERSION:
            raise ValueError(f"{where}: not an ngramrl step profile (no \"ngramrl_step_profile\": {PROFILE_VERSION})")

        def fail(key: str, expected: str, value: Any) -> ValueError:
            return ValueError(f"{where}: {key} must be {expected}, got {value!r}")

        def get(obj: dict[str, Any], key: str, inside: str = "") -> Any:
            if key not in obj:
                raise ValueError(f"{where}: malformed step profile: no {inside}{key}")
            return obj[key]

        def number(key: str, value: Any, expected: str, ok: Callable[[float], bool]) -> float:
            if not _is_real(value) or not ok(value):
                raise fail(key, expected, value)
            return float(value)

        source = get(data, "source")
        for key in ("model", "device"):
            if not isinstance(get(data, key), dict):
                raise fail(key, "a JSON object", data[key])
        k = get(data, "k")
        if not _is_int(k) or k < 1:
            raise fail("k", "an integer >= 1", k)
        grid = get(data, "grid")
        if not isinstance(grid, dict):
            raise fail("grid", "a JSON object", grid)
        axes: dict[str, list[int]] = {}
        for key in ("batch", "tokens_per_request", "context"):
            axes[key] = get(grid, key, "grid.")
            if not isinstance(axes[key], list) or not all(_is_int(v) for v in axes[key]):
                raise fail(f"grid.{key}", "a list of integers", axes[key])
        batches, tokens, contexts = axes["batch"], axes["tokens_per_request"], axes["context"]
        steps = get(data, "steps")
        if not isinstance(steps, list):
            raise fail("steps", "a list", steps)
        table: list[list[list[float | None]]] = [[[None] * len(contexts) for _ in tokens] for _ in batches]
        measured: list[list[list[bool]]] = [[[False] * len(contexts) for _ in tokens] for _ in batches]
        for i, entry in enumerate(steps):
            if not isinstance(entry, dict):
                raise fail(f"steps[{i}]", "a JSON object", entry)
            at = []
            for key, points in axes.items():
                value = get(entry, key, f"steps[{i}].")
                if not _is_int(value) or value not in points:
                    raise ValueError(f"{where}: steps[{i}].{key} {value!r} is not in grid.{key} {points}")
                at.append(points.index(value))
            b, t, c = at
            table[b][t][c] = number(f"steps[{i}].ms", get(entry, "ms", f"steps[{i}]."), "a number > 0",
                                    lambda v: v > 0)
            flag = entry.get("measured", False)
            if not isinstance(flag, bool):
                raise fail(f"steps[{i}].measured", "true or false", flag)
            measured[b][t][c] = flag
        missing = [(batches[b], tokens[t], contexts[c]) for b in range(len(batches)) for t in range(len(tokens))
                   for c in range(len(contexts)) if table[b][t][c] is None]
        if missing:
            raise ValueError(f"{where}: no step time for (batch, tokens per request, context) {missing[0]}"
                             f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}")
        host = data.get("host", {})
        if not isinstance(host, dict) or not set(host) <= {"base_ms", "per_request_ms"}:
            raise fail("host", "a JSON object of base_ms and per_request_ms", host)
        host_ms = {key: number(f"host.{key}", value, "a number >= 0", lambda v: v >= 0) for key, value in host.items()}
        prefill = number("prefill_ms_per_token", data.get("prefill_ms_per_token", 0.0), "a number >= 0",
                         lambda v: v >= 0)
        floor = data.get("floor_ms")
        if floor is not None:
            floor = number("floor_ms", floor, "a number > 0 or null", lambda v: v > 0)
        notes = data.get("notes", [])
        if not isinstance(notes, list) or not all(isinstance(note, str) for note in notes):
            raise fail("notes", "a list of strings", notes)
        try:
            return cls(source=source, model=data["model"], device=data["device"], k=k, batches=batches, tokens=tokens,
                       contexts=contexts, step_ms=table,  # type: ignore[arg-type]
                       measured=measured if any("measured" in e for e in steps) else None,
                       prefill_ms_per_token=prefill, host=HostOverhead(**host_ms), floor_ms=floor, notes=notes)
        except ValueError as err:  # __post_init__'s, which does not know the file
            raise ValueError(f"{where}: {err}") from None


def load_profile(path: str) -> StepProfile:
    if not os.path.exists(path):
        raise FileNotFoundError(f"profile {path} does not exist")
    return StepProfile.from_json(_read_json(path), path)


def write_profile(profile: StepProfile, path: str) -> None:
    with open(path, "w") as handle:
        json.dump(profile.to_json(), handle, indent=1)


def roofline_profile(gpu: str, shape: ModelShape, k: int = 8, settings: RooflineSettings | None = None,
                     host: HostOverhead | None = None, batches: tuple[int, ...] = DEFAULT_BATCHES,
                     contexts: tuple[int, ...] = DEFAULT_CONTEXTS) -> StepProfile:
    if gpu not in GPU_SPECS:
        raise ValueError(f"--roofline {gpu!r}: choose from {', '.join(GPU_SPECS)}")
    if k < 1:
        raise ValueError(f"--k must be >= 1, got {k}")
    spec = GPU_SPECS[gpu]
    settings = settings or RooflineSettings()
    tokens = default_tokens(k)
    table = [[[roofline_seconds(shape, spec, settings, b, q, c) * 1000.0 for c in contexts] for q in tokens]
             for b in batches]
    prefill = 4096  # a long prompt's tokens: compute-bound, so a per-token cost
    prefill_ms = (roofline_seconds(shape, spec, settings, 0, 1, 0, prefill) * 1000.0
                  - settings.step_overhead_ms) / prefill
    return StepProfile(
        source="roofline", model={"name": shape.name, **asdict(shape), "params": shape.params},
        device={"name": spec.name, **asdict(spec), **asdict(settings)}, k=k, batches=list(batches),
        tokens=list(tokens), contexts=list(contexts), step_ms=table, prefill_ms_per_token=prefill_ms,
        host=host or HostOverhead(), floor_ms=weight_read_seconds(shape, spec) * 1000.0,
        notes=[f"roofline of {spec.name} ({spec.bf16_tflops:g} TFLOP/s bf16 dense, {spec.bandwidth_tbs:g} TB/s) at "
               f"{settings.memory_efficiency:g} of its bandwidth and {settings.flop_efficiency:g} of its FLOP/s, "
               f"{settings.step_overhead_ms:g} ms per step on the device; not a measurement",
               "KV cache beyond the GPU's memory is not checked: a real engine would preempt or refuse such a batch"])
