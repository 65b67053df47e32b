"""Step times measured with PyTorch on the device present: ``ngramrl profile-gpu`` without ``--roofline``.

The model is built from its shape with random weights (nothing is downloaded): a dense decoder
laid out as engines run it (fused query/key/value and gate/up projections, a contiguous KV cache
per request, grouped-query attention with PyTorch's fused attention kernels, the output head over
every verified position and a greedy pass over the logits standing for the sampler). One decode
step of B requests with q tokens each (1, or 1 + draft tokens) at context c is timed after
warm-up; on CUDA each shape is captured as a CUDA graph and replayed, as vLLM replays its decode
steps, so the times carry no Python launch overhead. Elementwise operations are not fused, so
steps come out slower than in an engine (on an H200 a Qwen3-8B step of one request took 2.7x the
time of reading the weights once; docs/gpu.md).

A step of one token per request attends without a mask; a step of several needs the
bottom-right causal pattern, which PyTorch serves either through a grouped-query kernel with a
lower-right causal bias (FlashAttention where the build has it) or with the query heads folded
into rows and an additive mask (memory-efficient attention). The measurement times both once and
keeps the faster, as an engine keeps its fastest kernel.

The grid adapts to the device: a (batch, context) whose KV cache does not fit in the memory left
is skipped, and shapes not measured (memory, or the time budget spent) are extrapolated from
measured neighbours and marked ``"measured": false`` in the profile. Needs only PyTorch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from ngramrl.core.profile import (
    DEFAULT_BATCHES,
    DEFAULT_CONTEXTS,
    GPU_SPECS,
    HostOverhead,
    ModelShape,
    StepProfile,
    default_tokens,
    weight_read_seconds,
)

QUICK_BATCHES = (1, 8, 32, 128, 512)
# how a step of several tokens per request attends (Decoder.attention)
ATTENTION_KINDS = ("folded", "lower_right")


def _out_of_memory() -> type[BaseException]:
    try:
        import torch
    except ImportError:  # the roofline needs no PyTorch
        return MemoryError
    return getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", MemoryError)


OUT_OF_MEMORY = _out_of_memory()
QUICK_CONTEXTS = (512, 2048)


@dataclass
class MeasureConfig:
    device: str = "cuda"
    k: int = 8
    quick: bool = False
    time_budget_s: float = 420.0          # measuring stops after this long; the rest is extrapolated
    batches: tuple[int, ...] | None = None  # None: the default grid (or the quick one)
    tokens: tuple[int, ...] | None = None
    contexts: tuple[int, ...] | None = None
    dtype: str = "bfloat16"
    memory_fraction: float = 0.8          # of the memory free after the weights, for one shape's KV cache
    graphs: bool = True                   # CUDA graphs on CUDA devices
    target_s: float = 0.1                 # timed replays per shape: about this long (3 to 20 of them)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"--k must be >= 1, got {self.k}")
        if self.time_budget_s <= 0:
            raise ValueError(f"--time-budget-s must be > 0, got {self.time_budget_s}")
        if not 0.0 < self.memory_fraction < 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1), got {self.memory_fraction}")

    def grid(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        batches = self.batches or (QUICK_BATCHES if self.quick else DEFAULT_BATCHES)
        contexts = self.contexts or (QUICK_CONTEXTS if self.quick else DEFAULT_CONTEXTS)
        tokens = self.tokens or ((1, 3, self.k + 1) if self.quick else default_tokens(self.k))
        return tuple(sorted(set(batches))), tuple(sorted(set(tokens))), tuple(sorted(set(contexts)))


class Decoder:
    """A dense decoder of ``shape`` with random weights: embedding, per layer RMSNorm, fused QKV
    projection (biases where the shape has them), per-head query/key RMSNorm (Qwen3), rotary
    embedding, attention over a KV cache, output projection, RMSNorm and a gated SiLU MLP with
    fused gate/up; then the final norm and the output head. It computes what the Hugging Face
    model of that configuration computes, with either ``attention`` kind for steps of several
    tokens per request (tests/bench/test_gpu_profile.py checks it)."""

    attention = "folded"

    def __init__(self, shape: ModelShape, device: Any, dtype: Any, seed: int = 0) -> None:
        import torch

        self.shape, self.device, self.dtype = shape, device, dtype
        generator = torch.Generator(device=device).manual_seed(seed)
        h, d = shape.hidden, shape.head_dim

        def weight(*dims: int, scale: float = 0.02) -> Any:
            return torch.empty(*dims, dtype=dtype, device=device).normal_(0.0, scale, generator=generator)

        def ones(*dims: int) -> Any:
            return torch.ones(*dims, dtype=dtype, device=device)

        qkv = (shape.heads + 2 * shape.kv_heads) * d
        self.embed = weight(shape.vocab, h)
        self.layers = []
        for _ in range(shape.layers):
            self.layers.append({
                "norm1": ones(h), "qkv": weight(h, qkv), "qkv_bias": weight(qkv) if shape.qkv_bias else None,
                "q_norm": ones(d) if shape.qk_norm else None, "k_norm": ones(d) if shape.qk_norm else None,
                "o": weight(shape.heads * d, h), "norm2": ones(h), "gate_up": weight(h, 2 * shape.intermediate),
                "down": weight(shape.intermediate, h)})
        self.final_norm = ones(h)
        self.head = self.embed.t() if shape.tied_embeddings else weight(h, shape.vocab)
        self.inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))

    @classmethod
    def from_hf_state(cls, shape: ModelShape, state: dict[str, Any], device: Any, dtype: Any) -> Decoder:
        """The decoder with a Hugging Face model's weights (Llama, Qwen2, Qwen3 parameter names)."""
        import torch

        decoder = cls.__new__(cls)
        decoder.shape, decoder.device, decoder.dtype = shape, device, dtype

        def get(name: str) -> Any:
            return state[name].to(device=device, dtype=dtype)

        decoder.embed = get("model.embed_tokens.weight")
        decoder.layers = []
        for i in range(shape.layers):
            p = f"model.layers.{i}."
            attention = p + "self_attn."
            qkv = torch.cat([get(attention + f"{n}_proj.weight") for n in "qkv"], dim=0).t().contiguous()
            bias = (torch.cat([get(attention + f"{n}_proj.bias") for n in "qkv"]) if shape.qkv_bias else None)
            gate_up = torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")], dim=0)
            decoder.layers.append({
                "norm1": get(p + "input_layernorm.weight"), "qkv": qkv, "qkv_bias": bias,
                "q_norm": get(attention + "q_norm.weight") if shape.qk_norm else None,
                "k_norm": get(attention + "k_norm.weight") if shape.qk_norm else None,
                "o": get(attention + "o_proj.weight").t().contiguous(),
                "norm2": get(p + "post_attention_layernorm.weight"), "gate_up": gate_up.t().contiguous(),
                "down": get(p + "mlp.down_proj.weight").t().contiguous()})
        decoder.final_norm = get("model.norm.weight")
        head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
        decoder.head = head.to(device=device, dtype=dtype).t()
        d = shape.head_dim
        decoder.inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
        return decoder

    def new_cache(self, batch: int, length: int) -> Any:
        """Keys and values for ``batch`` requests of up to ``length`` tokens: [2, layers, batch,
        kv heads, length, head dim]."""
        import torch

        s = self.shape
        return torch.zeros(2, s.layers, batch, s.kv_heads, length, s.head_dim, dtype=self.dtype, device=self.device)

    def cache_bytes(self, batch: int, length: int) -> int:
        return batch * length * self.shape.kv_bytes_per_token

    def _norm(self, x: Any, weight: Any) -> Any:
        import torch

        variance = x.float().pow(2).mean(-1, keepdim=True)
        return weight * (x.float() * torch.rsqrt(variance + self.shape.rms_eps)).to(x.dtype)

    def rotary(self, start: int, tokens: int) -> tuple[Any, Any]:
        import torch

        positions = torch.arange(start, start + tokens, dtype=torch.float32, device=self.device)
        freqs = torch.outer(positions, self.inv_freq)
        angles = torch.cat([freqs, freqs], dim=-1)
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)

    @staticmethod
    def _rotate(x: Any, cos: Any, sin: Any) -> Any:
        import torch

        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def attention_mask(self, start: int, tokens: int) -> Any:
        """What the attention of ``tokens`` new tokens after ``start`` cached ones needs: None
        when a single new token sees everything; for ``lower_right`` PyTorch's bottom-right causal
        bias; for ``folded`` an additive mask over the rows as that attention lays them out
        (token-major, then the query heads sharing a key head), made once per shape and with its
        rows 16-aligned in memory, so the kernel neither converts nor pads it at every layer."""
        import torch

        if tokens == 1:
            return None
        length = start + tokens
        if self.attention == "lower_right":
            from torch.nn.attention.bias import causal_lower_right

            return causal_lower_right(tokens, length)
        group = self.shape.heads // self.shape.kv_heads
        visible = (torch.arange(length, device=self.device)[None, :]
                   <= start + torch.arange(tokens, device=self.device)[:, None]).repeat_interleave(group, dim=0)
        padded = -(-length // 16) * 16
        bias = torch.full((tokens * group, padded), float("-inf"), dtype=self.dtype, device=self.device)
        bias[:, :length].masked_fill_(visible, 0.0)
        return bias[:, :length]

    def forward(self, ids: Any, cache: Any, start: int, cos: Any, sin: Any, mask: Any) -> Any:
        """One step: ``ids`` [batch, tokens] at positions start.., the cache holding positions
        < start; writes this step's keys and values into it and returns the logits [batch,
        tokens, vocab]."""
        import torch.nn.functional as F

        s = self.shape
        batch, tokens = ids.shape
        group = s.heads // s.kv_heads
        end = start + tokens
        x = self.embed[ids]
        for index, layer in enumerate(self.layers):
            h = self._norm(x, layer["norm1"])
            qkv = h @ layer["qkv"]
            if layer["qkv_bias"] is not None:
                qkv = qkv + layer["qkv_bias"]
            q, k, v = qkv.split([s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], dim=-1)
            q = q.view(batch, tokens, s.heads, s.head_dim)
            k = k.view(batch, tokens, s.kv_heads, s.head_dim)
            if layer["q_norm"] is not None:
                q, k = self._norm(q, layer["q_norm"]), self._norm(k, layer["k_norm"])
            q = self._rotate(q, cos[:, None, :], sin[:, None, :])
            k = self._rotate(k, cos[:, None, :], sin[:, None, :])
            cache[0, index, :, :, start:end] = k.transpose(1, 2)
            cache[1, index, :, :, start:end] = v.view(batch, tokens, s.kv_heads, s.head_dim).transpose(1, 2)
            keys, values = cache[0, index, :, :, :end], cache[1, index, :, :, :end]
            if mask is not None and self.attention == "lower_right":
                out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True)
                out = out.transpose(1, 2)
            else:
                # grouped-query attention: the query heads sharing a key head attend as extra rows
                rows = q.view(batch, tokens, s.kv_heads, group, s.head_dim).permute(0, 2, 1, 3, 4)
                rows = rows.reshape(batch, s.kv_heads, tokens * group, s.head_dim)
                out = F.scaled_dot_product_attention(rows, keys, values, attn_mask=mask)
                out = out.view(batch, s.kv_heads, tokens, group, s.head_dim).permute(0, 2, 1, 3, 4)
            x = x + out.reshape(batch, tokens, s.heads * s.head_dim) @ layer["o"]
            h = self._norm(x, layer["norm2"])
            gate, up = (h @ layer["gate_up"]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer["down"]
        return self._norm(x, self.final_norm) @ self.head

    def step(self, ids: Any, cache: Any, start: int, cos: Any, sin: Any, mask: Any) -> Any:
        """A decode step as an engine runs it: the forward and a greedy pass over the logits."""
        return self.forward(ids, cache, start, cos, sin, mask).argmax(dim=-1)


def _device_name(device: Any) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def _known_gpu(name: str) -> str | None:
    lowered = name.lower()
    return next((key for key in GPU_SPECS if key in lowered), None)


class _Timer:
    """Times a callable on the device, as a CUDA graph where it can be captured."""

    def __init__(self, device: Any, graphs: bool) -> None:
        self.device = device
        self.graphs = graphs and device.type == "cuda"
        self.failures: list[str] = []

    def _sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time(self, run: Callable[[], Any], target_s: float) -> tuple[float, str]:
        """Median seconds per call, and how it ran ("graph" or "eager")."""
        import torch

        replay, mode, graph = run, "eager", None
        if self.graphs:
            try:
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    run()
                    run()
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    run()
                replay, mode = graph.replay, "graph"
            except RuntimeError as err:  # a kernel that cannot be captured: time it eagerly
                if isinstance(err, OUT_OF_MEMORY):
                    raise
                self.failures.append(str(err).splitlines()[0][:200])
                self.graphs = False
                graph = None
                self._sync()
        replay()
        self._sync()
        begin = time.perf_counter()
        replay()
        self._sync()
        first = time.perf_counter() - begin
        repeats = int(min(20, max(3, target_s / max(first, 1e-6))))
        times = []
        for _ in range(repeats):
            begin = time.perf_counter()
            replay()
            self._sync()
            times.append(time.perf_counter() - begin)
        del graph
        times.sort()
        return times[len(times) // 2], mode


def _time_step(timer: _Timer, decoder: Decoder, cache: Any, batch: int, tokens: int, start: int,
               target_s: float) -> tuple[float, str]:
    """Seconds of one step of ``batch`` requests, ``tokens`` each, after ``start`` cached tokens."""
    import torch

    ids = torch.randint(0, decoder.shape.vocab, (batch, tokens), device=decoder.device)
    cos, sin = decoder.rotary(start, tokens)
    mask = decoder.attention_mask(start, tokens)
    return timer.time(lambda: decoder.step(ids, cache, start, cos, sin, mask), target_s)


def choose_attention(decoder: Decoder, graphs: bool, tokens: int, context: int, batch: int = 8,
                     target_s: float = 0.05) -> tuple[str, dict[str, float | str]]:
    """The faster of the ``ATTENTION_KINDS`` for steps of ``tokens`` tokens per request, timed at
    one shape; a kind that fails, cannot be captured as a CUDA graph where graphs are asked for, or
    computes other logits than the first is left out. Returns the kind chosen (also set on the
    decoder) and each kind's milliseconds or why it was left out."""
    import torch

    cache = decoder.new_cache(batch, context + tokens)
    ids = torch.randint(0, decoder.shape.vocab, (batch, tokens), device=decoder.device)
    cos, sin = decoder.rotary(context, tokens)
    tried: dict[str, float | str] = {}
    reference = None
    for kind in ATTENTION_KINDS:
        decoder.attention = kind
        try:
            mask = decoder.attention_mask(context, tokens)
            logits = decoder.forward(ids, cache, context, cos, sin, mask).float()
            if reference is None:
                reference = logits
            elif not torch.allclose(logits, reference, atol=0.05 * float(reference.abs().max()), rtol=0.0):
                tried[kind] = "other logits than " + ATTENTION_KINDS[0]
                continue
            timer = _Timer(decoder.device, graphs)
            seconds, _ = timer.time(lambda mask=mask: decoder.step(ids, cache, context, cos, sin, mask), target_s)
            if timer.failures:
                tried[kind] = f"not captured as a CUDA graph: {timer.failures[0]}"
                continue
        except RuntimeError as err:
            if isinstance(err, OUT_OF_MEMORY):
                raise
            tried[kind] = f"failed: {str(err).splitlines()[0][:160]}"
            continue
        tried[kind] = round(seconds * 1000.0, 4)
    timed = {kind: ms for kind, ms in tried.items() if isinstance(ms, float)}
    if not timed:
        raise RuntimeError(f"no attention kind runs here: {tried}")
    decoder.attention = min(timed, key=timed.__getitem__)
    return decoder.attention, tried


def _free_memory(device: Any) -> int | None:
    import torch

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return None


def measure_profile(shape: ModelShape, config: MeasureConfig | None = None, host: HostOverhead | None = None,
                    progress: bool = False, log: Callable[[str], None] = print) -> StepProfile:
    import torch

    config = config or MeasureConfig()
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: PyTorch sees no CUDA device here (use --device cpu, or --roofline)")
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # CUDA graphs capture on the current device's stream
    dtype = getattr(torch, config.dtype)
    batches, tokens, contexts = config.grid()
    started = time.perf_counter()
    torch.manual_seed(config.seed)
    decoder = Decoder(shape, device, dtype, config.seed)
    built = time.perf_counter() - started
    timer = _Timer(device, config.graphs)
    attention, attention_ms = None, {}
    table: list[list[list[float | None]]] = [[[None] * len(contexts) for _ in tokens] for _ in batches]
    skipped_memory = 0
    stopped = False
    with torch.inference_mode():
        if max(tokens) > 1:
            attention, attention_ms = choose_attention(decoder, timer.graphs, max(tokens),
                                                       contexts[len(contexts) // 2])
            if device.type == "cuda":
                torch.cuda.empty_cache()
        free = _free_memory(device)
        for b, batch in enumerate(batches):
            for c, context in enumerate(contexts):
                length = context + max(tokens)
                if free is not None and decoder.cache_bytes(batch, length) > config.memory_fraction * free:
                    skipped_memory += len(tokens)
                    continue
                if time.perf_counter() - started > config.time_budget_s:
                    stopped = True
                    break
                cache = decoder.new_cache(batch, length)
                for t, count in enumerate(tokens):
                    if time.perf_counter() - started > config.time_budget_s:
                        stopped = True
                        break
                    try:
                        seconds, mode = _time_step(timer, decoder, cache, batch, count, context, config.target_s)
                    except OUT_OF_MEMORY:
                        skipped_memory += 1
                        torch.cuda.empty_cache()
                        continue
                    table[b][t][c] = seconds * 1000.0
                    if progress:
                        log(f"profile-gpu: batch {batch:>5} tokens/request {count:>2} context {context:>6}: "
                            f"{seconds * 1000:9.3f} ms ({mode}; {time.perf_counter() - started:6.1f} s)")
                del cache
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                if stopped:
                    break
            if stopped:
                break
        prefill_tokens = min(2048, max(contexts))  # one long prompt: its cost per token
        prefill_s, _ = _time_step(_Timer(device, False), decoder, decoder.new_cache(1, prefill_tokens), 1,
                                  prefill_tokens, 0, 0.0)
    measured = [[[v is not None for v in cell] for cell in row] for row in table]
    count = sum(v for row in measured for cell in row for v in cell)
    if count == 0:
        raise RuntimeError("no step could be measured (the model may not fit on this device)")
    filled = fill_missing(table, batches, tokens, contexts)
    name = _device_name(device)
    gpu = _known_gpu(name)
    total = len(batches) * len(tokens) * len(contexts)
    notes = [f"measured with PyTorch {torch.__version__} on {name}: {count} of {total} shapes "
             f"({'CUDA graphs' if timer.graphs else 'eager'}); model built in {built:.1f} s, random weights"]
    if skipped_memory:
        notes.append(f"{skipped_memory} shapes did not fit in the device's memory and are extrapolated")
    if stopped:
        notes.append(f"the time budget ({config.time_budget_s:g} s) ran out; shapes not measured are extrapolated")
    if attention is not None:
        notes.append(f"steps of several tokens per request attend as {attention!r}, the faster at batch 8, "
                     f"{max(tokens)} tokens, context {contexts[len(contexts) // 2]}: "
                     + ", ".join(f"{kind} {ms} ms" if isinstance(ms, float) else f"{kind} {ms}"
                                 for kind, ms in attention_ms.items()))
    if timer.failures:
        notes.append(f"CUDA graph capture failed, timed eagerly after: {timer.failures[0]}")
    return StepProfile(
        source="measured", model={"name": shape.name, **asdict(shape), "params": shape.params},
        device={"name": gpu or name, "device_name": name, "torch": torch.__version__, "dtype": config.dtype,
                "graphs": timer.graphs, "attention": attention},
        k=config.k, batches=list(batches), tokens=list(tokens), contexts=list(contexts), step_ms=filled,
        measured=measured, prefill_ms_per_token=prefill_s * 1000.0 / prefill_tokens, host=host or HostOverhead(),
        floor_ms=weight_read_seconds(shape, GPU_SPECS[gpu]) * 1000.0 if gpu else None, notes=notes)


def fill_missing(table: list[list[list[float | None]]], batches: tuple[int, ...], tokens: tuple[int, ...],
                 contexts: tuple[int, ...]) -> list[list[list[float]]]:
    """Entries not measured, from measured neighbours: linearly along context (attention reads
    grow with it), then along batch and tokens per request, extrapolating from the two nearest
    known points, until every entry is known."""
    axes = (batches, tokens, contexts)
    dims = tuple(len(axis) for axis in axes)

    def get(index: tuple[int, int, int]) -> float | None:
        return table[index[0]][index[1]][index[2]]

    changed = True
    while changed:
        changed = False
        for axis in (2, 0, 1):
            for b in range(dims[0]):
                for t in range(dims[1]):
                    for c in range(dims[2]):
                        index = [b, t, c]
                        if get(tuple(index)) is not None:
                            continue
                        known = []
                        for i in range(dims[axis]):
                            index[axis] = i
                            value = get(tuple(index))
                            if value is not None:
                                known.append((axes[axis][i], value))
                        if len(known) < 2:
                            continue
                        target = axes[axis][[b, t, c][axis]]
                        near = sorted(known, key=lambda kv: (abs(kv[0] - target), kv[0]))[:2]
                        (x0, y0), (x1, y1) = sorted(near)
                        value = y0 + (y1 - y0) * (target - x0) / (x1 - x0)
                        # more of anything never makes a step faster; less never slower, nor
                        # below half the smaller neighbour
                        if target > x1:
                            value = max(value, y1)
                        elif target < x0:
                            value = min(max(value, 0.5 * y0), y0)
                        table[b][t][c] = value
                        changed = True
    missing = [(batches[b], tokens[t], contexts[c]) for b in range(dims[0]) for t in range(dims[1])
               for c in range(dims[2]) if table[b][t][c] is None]
    if missing:
        raise RuntimeError(f"too few shapes measured to extrapolate (batch, tokens per request, context) {missing[0]}")
    return table  # type: ignore[return-value]
