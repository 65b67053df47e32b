"""Rollout traces: the version-1 JSON Lines format of ``docs/trace-format.md``.

A reader validates every line and stops at the first problem with the file, the line and
what is wrong; it never guesses or skips. A writer sorts by (epoch, prompt_id, sample).
"""

from __future__ import annotations

import gzip
import io
import json
import math
import os
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

TRACE_VERSION = 1
MAX_TOKEN_ID = 2**31 - 1  # token ids are 32-bit in vLLM and in the native core
FINISH_REASONS = ("stop", "length")
TRACE_EXTENSIONS = (".jsonl.gz", ".jsonl", ".json.gz", ".json", ".gz")  # longest first: the workload is the rest


class TraceError(ValueError):
    """A trace file is malformed; the message names the file, the line (None: the file as a whole)
    and the problem."""

    def __init__(self, path: str, line: int | None, problem: str) -> None:
        super().__init__(f"{path}: {problem}" if line is None else f"{path}:{line}: {problem}")
        self.path = path
        self.line = line
        self.problem = problem


@dataclass
class TraceHeader:
    vocab_size: int
    eos_token_ids: list[int]
    model: str | None = None
    tokenizer: str | None = None
    workload: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ngramrl_trace": TRACE_VERSION, **self.extra}
        for key in ("model", "tokenizer"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        out["vocab_size"] = self.vocab_size
        out["eos_token_ids"] = list(self.eos_token_ids)
        for key in ("workload", "temperature", "top_p", "top_k", "max_tokens"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


@dataclass
class Rollout:
    prompt_id: str
    epoch: int
    sample: int
    prompt: list[int]
    output: list[int]
    finish_reason: str | None = None
    reward: float | None = None
    policy_version: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt_id": self.prompt_id,
            "epoch": self.epoch,
            "sample": self.sample,
            "prompt": list(self.prompt),
            "output": list(self.output),
        }
        for key in ("finish_reason", "reward", "policy_version"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


@dataclass
class Trace:
    header: TraceHeader
    rollouts: list[Rollout]
    path: str = "<memory>"

    @property
    def workload(self) -> str:
        if self.header.workload:
            return self.header.workload
        name = os.path.basename(self.path)
        for extension in TRACE_EXTENSIONS:  # a name's other dots are its own ("gsm-t0.6")
            if name.endswith(extension):
                return name[: -len(extension)]
        return name

    def epochs(self) -> list[int]:
        return sorted({r.epoch for r in self.rollouts})


class _Prefix(io.RawIOBase):
    """The first ``length`` bytes of a file, read as a file."""

    def __init__(self, path: str, length: int) -> None:
        self._file = open(path, "rb")  # noqa: SIM115 - closed with this reader
        self._left = length

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer)[:self._left]
        count = self._file.readinto(view)
        self._left -= count
        return count

    def close(self) -> None:
        self._file.close()
        super().close()


def _open_text(path: str, mode: str, length: int | None = None) -> io.TextIOBase:
    if length is not None:
        raw = io.BufferedReader(_Prefix(path, length))
        binary = gzip.GzipFile(fileobj=raw, mode="rb") if path.endswith(".gz") else raw
        return io.TextIOWrapper(binary, encoding="utf-8")
    if path.endswith(".gz"):
        return gzip.open(path, mode + "t", encoding="utf-8")  # type: ignore[return-value]
    return open(path, mode, encoding="utf-8")


def whole_length(path: str) -> int:
    """How much of a trace is whole: a .gz trace grows by one gzip member per append, a plain one
    by whole lines, and a writer stopped in an append leaves a torn last one past this length."""
    if not path.endswith(".gz"):
        with open(path, "rb") as handle:
            return handle.read().rfind(b"\n") + 1
    with open(path, "rb") as handle:
        return _whole_members(handle)


def _whole_members(handle: Any) -> int:
    whole = consumed = 0
    member = zlib.decompressobj(31)
    try:
        while chunk := handle.read(1 << 20):
            while chunk:
                member.decompress(chunk, 1 << 16)  # the text is not kept: only where members end
                while member.unconsumed_tail:
                    member.decompress(member.unconsumed_tail, 1 << 16)
                if not member.eof:
                    consumed += len(chunk)
                    break
                consumed += len(chunk) - len(member.unused_data)
                whole = consumed
                chunk = member.unused_data
                member = zlib.decompressobj(31)
    except zlib.error:  # bytes after the last whole member that start no gzip member
        pass
    return whole


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A finite JSON number (Python's json reads NaN and Infinity, which strict JSON has not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _token_list(path: str, line: int, name: str, value: Any, vocab_size: int) -> list[int]:
    if not isinstance(value, list):
        raise TraceError(path, line, f"'{name}' must be a list of token ids, got {type(value).__name__}")
    for position, token in enumerate(value):
        if not _is_int(token):
            raise TraceError(path, line, f"'{name}'[{position}] is not an integer: {token!r}")
        if not 0 <= token < vocab_size:
            raise TraceError(
                path, line, f"'{name}'[{position}] = {token} is out of range [0, {vocab_size})"
            )
    return value


def _parse_header(path: str, raw: str) -> TraceHeader:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as err:
        raise TraceError(path, 1, f"header is not JSON ({err.msg})") from None
    if not isinstance(obj, dict):
        raise TraceError(path, 1, "header must be a JSON object")
    version = obj.get("ngramrl_trace")
    if version is None:
        raise TraceError(path, 1, "header is missing 'ngramrl_trace' (is this a trace file?)")
    if not _is_int(version) or version != TRACE_VERSION:
        raise TraceError(path, 1, f"unsupported trace version {version!r} (this reader knows {TRACE_VERSION})")
    vocab_size = obj.get("vocab_size")
    if not _is_int(vocab_size) or vocab_size <= 0:
        raise TraceError(path, 1, f"header 'vocab_size' must be a positive integer, got {vocab_size!r}")
    if vocab_size > MAX_TOKEN_ID + 1:
        raise TraceError(path, 1, f"header 'vocab_size' must be at most 2^31, got {vocab_size}: token ids are "
                                  f"32-bit in vLLM and in ngramrl's core")
    eos = obj.get("eos_token_ids")
    if not isinstance(eos, list) or not all(_is_int(t) for t in eos):
        raise TraceError(path, 1, f"header 'eos_token_ids' must be a list of integers, got {eos!r}")
    _token_list(path, 1, "eos_token_ids", eos, vocab_size)
    known = {"ngramrl_trace", "vocab_size", "eos_token_ids", "model", "tokenizer", "workload",
             "temperature", "top_p", "top_k", "max_tokens"}
    for key in ("model", "tokenizer", "workload"):
        if key in obj and obj[key] is not None and not isinstance(obj[key], str):
            raise TraceError(path, 1, f"header '{key}' must be a string, got {obj[key]!r}")
    for key in ("temperature", "top_p"):
        if key in obj and obj[key] is not None and not _is_number(obj[key]):
            raise TraceError(path, 1, f"header '{key}' must be a number, got {obj[key]!r}")
    for key in ("top_k", "max_tokens"):
        if key in obj and obj[key] is not None and not _is_int(obj[key]):
            raise TraceError(path, 1, f"header '{key}' must be an integer, got {obj[key]!r}")
    return TraceHeader(
        vocab_size=vocab_size,
        eos_token_ids=list(eos),
        model=obj.get("model"),
        tokenizer=obj.get("tokenizer"),
        workload=obj.get("workload"),
        temperature=obj.get("temperature"),
        top_p=obj.get("top_p"),
        top_k=obj.get("top_k"),
        max_tokens=obj.get("max_tokens"),
        extra={k: v for k, v in obj.items() if k not in known},
    )


def _parse_rollout(path: str, line: int, raw: str, vocab_size: int) -> Rollout:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as err:
        raise TraceError(path, line, f"not JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(path, line, "a rollout must be a JSON object")
    for key in ("prompt_id", "epoch", "sample", "prompt", "output"):
        if key not in obj:
            raise TraceError(path, line, f"missing required field '{key}'")
    if not isinstance(obj["prompt_id"], str):
        raise TraceError(path, line, f"'prompt_id' must be a string, got {obj['prompt_id']!r}")
    for key in ("epoch", "sample"):
        if not _is_int(obj[key]) or obj[key] < 0:
            raise TraceError(path, line, f"'{key}' must be an integer >= 0, got {obj[key]!r}")
    prompt = _token_list(path, line, "prompt", obj["prompt"], vocab_size)
    output = _token_list(path, line, "output", obj["output"], vocab_size)
    finish = obj.get("finish_reason")
    if finish is not None and finish not in FINISH_REASONS:
        raise TraceError(path, line, f"'finish_reason' must be one of {FINISH_REASONS}, got {finish!r}")
    reward = obj.get("reward")
    if reward is not None and not _is_number(reward):
        raise TraceError(path, line, f"'reward' must be a number, got {reward!r}")
    version = obj.get("policy_version")
    if version is not None and not _is_int(version):
        raise TraceError(path, line, f"'policy_version' must be an integer, got {version!r}")
    return Rollout(obj["prompt_id"], obj["epoch"], obj["sample"], prompt, output, finish, reward, version)


_GZIP_HINT = " (the file is gzip-compressed: name it .jsonl.gz)"


def is_gzip(path: str) -> bool:
    """Whether the file starts as gzip does (whatever its name says)."""
    try:
        with open(path, "rb") as handle:
            return handle.read(2) == b"\x1f\x8b"
    except OSError:
        return False


def iter_trace(path: str, length: int | None = None) -> Iterator[TraceHeader | Rollout]:
    """Yield the header, then each rollout, validating as it goes; ``length``: read only the file's
    first bytes (its whole part, ``whole_length``, where a writer was stopped mid-append)."""
    prompts: dict[str, list[int]] = {}
    seen: dict[tuple[str, int, int], int] = {}  # (prompt_id, epoch, sample) -> its line
    last_epoch = -1
    header: TraceHeader | None = None
    try:
        with _open_text(path, "r", length) as handle:
            for line_no, raw in enumerate(handle, start=1):
                if header is None:
                    header = _parse_header(path, raw)
                    yield header
                    continue
                if not raw.strip():
                    raise TraceError(path, line_no, "empty line")
                rollout = _parse_rollout(path, line_no, raw, header.vocab_size)
                if rollout.epoch < last_epoch:
                    raise TraceError(
                        path, line_no, f"epoch goes backwards ({rollout.epoch} after {last_epoch})"
                    )
                last_epoch = rollout.epoch
                key = (rollout.prompt_id, rollout.epoch, rollout.sample)
                if key in seen:
                    raise TraceError(path, line_no, f"rollout (prompt_id {rollout.prompt_id!r}, epoch "
                                                    f"{rollout.epoch}, sample {rollout.sample}) appears twice "
                                                    f"(first on line {seen[key]})")
                seen[key] = line_no
                known = prompts.setdefault(rollout.prompt_id, rollout.prompt)
                if known != rollout.prompt:
                    raise TraceError(
                        path, line_no, f"prompt_id {rollout.prompt_id!r} has different prompt tokens than before"
                    )
                yield rollout
    except UnicodeDecodeError as err:
        raise TraceError(path, None, f"cannot read file: {err}" + _GZIP_HINT * is_gzip(path)) from None
    except EOFError as err:  # the last gzip member cut short
        raise TraceError(path, None, f"cannot read file: {err}; it ends in the middle of an append (a run "
                                     f"still writing it, or one stopped mid-append: `ngramrl train --resume` "
                                     f"cuts the torn end off)") from None
    except OSError as err:
        raise TraceError(path, None, f"cannot read file: {err}") from None
    except zlib.error as err:  # a gzip stream damaged past its header
        raise TraceError(path, None, f"cannot read file: corrupt gzip data ({err})") from None
    if header is None:
        raise TraceError(path, 1, "file is empty (no header line)")


def read_trace(path: str) -> Trace:
    items = iter(iter_trace(path))
    header = next(items)
    assert isinstance(header, TraceHeader)
    rollouts = [item for item in items if isinstance(item, Rollout)]
    return Trace(header, rollouts, path)


def model_vocab_size(model_dir: str, tokenizer_size: int) -> int:
    """The header's ``vocab_size`` for rollouts of the model in ``model_dir``: the larger of its
    tokenizer's size and its embedding table's (config.json), which models pad to a multiple and
    may sample from."""
    try:
        with open(os.path.join(model_dir, "config.json")) as handle:
            config = json.load(handle)
    except (OSError, ValueError):
        return tokenizer_size
    sizes = [config.get("vocab_size"), (config.get("text_config") or {}).get("vocab_size")]
    return max([tokenizer_size, *(s for s in sizes if _is_int(s))])


def write_trace(path: str, header: TraceHeader, rollouts: Iterable[Rollout]) -> None:
    """Write atomically (temporary file, then rename) so a crash never leaves half a trace."""
    ordered = sorted(rollouts, key=lambda r: (r.epoch, r.prompt_id, r.sample))
    tmp = f"{path}.tmp-{os.getpid()}"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    handle = gzip.open(tmp, "wt", encoding="utf-8") if path.endswith(".gz") else open(tmp, "w", encoding="utf-8")
    try:
        with handle:
            handle.write(json.dumps(header.to_json(), allow_nan=False) + "\n")
            for rollout in ordered:
                handle.write(json.dumps(rollout.to_json(), separators=(",", ":"), allow_nan=False) + "\n")
    except BaseException:
        os.unlink(tmp)
        raise
    os.replace(tmp, path)


class TraceWriter:
    """A trace written as it grows: each ``flush`` appends the rollouts added since the last one
    (for a .gz trace, one gzip member), synced to disk, so a flush costs what it adds, not the
    whole trace so far (a long RL run's trace is gigabytes). The file is valid after every flush.
    A flush whose rollouts would put an epoch before one already written (the format orders by
    epoch) rewrites the file sorted, atomically, instead. ``continue_at``: append to the file's
    first ``continue_at`` bytes (``whole_length``: an earlier writer may have been stopped in an
    append), which hold ``count`` rollouts up to epoch ``last_epoch``."""

    def __init__(self, path: str, header: TraceHeader, continue_at: int | None = None, count: int = 0,
                 last_epoch: int = -1) -> None:
        self.path = path
        self.header = header
        self.pending: list[Rollout] = []
        self.count = count
        self.last_epoch = last_epoch
        self._started = bool(continue_at)  # (nothing whole: the first flush writes the file anew)
        if continue_at and os.path.getsize(path) > continue_at:
            with open(path, "r+b") as handle:
                handle.truncate(continue_at)

    def add(self, rollout: Rollout) -> None:
        self.pending.append(rollout)

    def flush(self) -> None:
        batch = sorted(self.pending, key=lambda r: (r.epoch, r.prompt_id, r.sample))
        if not self._started:
            write_trace(self.path, self.header, batch)
            self._started = True
        elif batch and batch[0].epoch < self.last_epoch:
            written = [item for item in iter_trace(self.path) if isinstance(item, Rollout)]
            write_trace(self.path, self.header, written + batch)
        elif batch:
            lines = "".join(json.dumps(r.to_json(), separators=(",", ":"), allow_nan=False) + "\n" for r in batch)
            data = lines.encode("utf-8")
            with open(self.path, "ab") as handle:
                handle.write(gzip.compress(data, compresslevel=6, mtime=0) if self.path.endswith(".gz") else data)
                handle.flush()
                os.fsync(handle.fileno())
        self.count += len(batch)
        if batch:
            self.last_epoch = max(self.last_epoch, batch[-1].epoch)
        self.pending.clear()
