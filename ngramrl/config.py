"""Configuration: one dataclass per component, validated on construction, composed top-down."""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


def fits(value: Any, hint: Any) -> tuple[bool, Any]:
    """Whether ``value`` fits a field typed ``hint`` (int, float, bool, str, tuple[int, ...], unions
    with None), and the value to keep (ints widened to floats, sequences to tuples)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            ok, kept = (value is None, None) if option is type(None) else fits(value, option)
            if ok:
                return True, kept
        return False, value
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:  # NumPy's integers too (token ids often come from arrays)
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        return ok, int(value) if ok and type(value) is not int else value
    if hint is float:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        return ok, float(value) if ok and type(value) is not float else value
    if hint is str:
        return isinstance(value, str), value
    if typing.get_origin(hint) is tuple:
        if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable):
            return False, value
        item = typing.get_args(hint)[0]
        kept = []
        for v in value:
            ok, v = fits(v, item)
            if not ok:
                return False, value
            kept.append(v)
        return True, tuple(kept)
    return True, value


def describe(hint: Any) -> str:
    """A field type in words, for error messages."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join("None" if option is type(None) else describe(option) for option in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        return f"a list of {describe(typing.get_args(hint)[0]).removeprefix('an ').removeprefix('a ')}s"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(hint, str(hint))


def number(text: str) -> float:
    """A command-line flag's number (argparse's ``type``): NaN and infinity pass every range check
    and fail late (a NaN temperature samples greedily, then the trace refuses it), so they are
    refused with the flag's name before any work."""
    import argparse

    value = float(text)  # argparse turns a ValueError into "invalid number value: 'x'"
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def check_types(config: Any) -> None:
    """Every field of the dataclass ``config`` holds a value of its declared type, or a ValueError
    naming the class and the field (``DrafterConfig.stop_tokens must be ...``)."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        ok, kept = fits(value, hints[f.name])
        if not ok:
            raise ValueError(f"{type(config).__name__}.{f.name} must be {describe(hints[f.name])}, got {value!r}")
        if isinstance(kept, float) and not math.isfinite(kept):  # NaN passes every range check
            raise ValueError(f"{type(config).__name__}.{f.name} must be a finite number, got {value!r}")
        if kept is not value:
            object.__setattr__(config, f.name, kept)


@dataclass
class HistoryConfig:
    """How much rollout history is kept, per prompt and in total."""

    rollouts_per_prompt: int = 64      # most recent finished rollouts kept for one prompt
    epochs_kept: int = 4               # rollouts older than this many epochs behind the newest are dropped
    max_tokens: int = 8_000_000        # global cap on stored tokens (about 400 B each); LRU prompts go first
    prompt_tail: int = 8               # prompt tokens stored before each rollout, so its first tokens can be drafted

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("rollouts_per_prompt", "epochs_kept", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"HistoryConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.prompt_tail < 0:
            raise ValueError(f"HistoryConfig.prompt_tail must be >= 0, got {self.prompt_tail}")


@dataclass
class DrafterConfig:
    """How drafts are chosen from the history."""

    max_draft: int = 16                # k: the most tokens proposed per step
    min_confidence: float = 0.0        # stop a draft once its estimated chance of surviving drops below this
    min_match: int = 1                 # shortest context match (tokens) that may produce a draft
    rematch_tokens: int = 32           # context tokens re-read when an index was rebuilt
    use_self: bool = True              # also draft from the request's own output (loops, repeats)
    use_global: bool = True            # other prompts' rollouts take the estimate's mass this prompt leaves
    levels: int = 3                    # suffix levels per index the continuation estimate interpolates
    path_width: int = 1                # root paths compared when choosing a chain by expected accepted length
    stop_tokens: tuple[int, ...] = ()  # end-of-sequence ids: nothing after them is ever accepted

    def __post_init__(self) -> None:
        check_types(self)  # stop_tokens: any sequence of ints, kept as a tuple
        if any(t < 0 for t in self.stop_tokens):
            raise ValueError(f"DrafterConfig.stop_tokens must be token ids >= 0, got {self.stop_tokens!r}")
        if self.max_draft < 0:
            raise ValueError(f"DrafterConfig.max_draft must be >= 0, got {self.max_draft}")
        if not 0.0 <= self.min_confidence <= 1.0:
            raise ValueError(f"DrafterConfig.min_confidence must be in [0, 1], got {self.min_confidence}")
        if self.min_match < 1 or self.rematch_tokens < 1:
            raise ValueError("DrafterConfig.min_match and rematch_tokens must be >= 1")
        if self.levels < 1 or self.path_width < 1:
            raise ValueError(f"DrafterConfig.levels and path_width must be >= 1, got {self.levels}, "
                             f"{self.path_width}")


@dataclass
class PrefetchConfig:
    """How verification outcomes are predicted and how many next drafts are looked up ahead."""

    budget: int = 16                   # next-draft lookups per request per step (on average, when shared)
    max_budget: int = 64               # where the forward leaves the background idle, budget grows up to this
    global_budget: int | None = None   # optional cap for the whole batch (fan-out follows uncertainty)
    share_budget: bool = True          # without a global budget: budget x requests across the batch
    min_probability: float = 0.0       # outcomes less likely than this are never prefetched
    plan_floor: float = 0.5            # with a batch budget: enumerate only outcomes above this x the last cut
    levels: int = 3                    # suffix levels whose continuations are candidate corrections
    prior_strength: float = 4.0        # pseudo-observations behind the drafter's own estimate
    calibration_decay: float = 0.99    # forgetting per observation of a calibration cell (acceptance drifts)

    def __post_init__(self) -> None:
        check_types(self)
        if self.budget < 0:
            raise ValueError(f"PrefetchConfig.budget must be >= 0, got {self.budget}")
        if self.max_budget < 0:
            raise ValueError(f"PrefetchConfig.max_budget must be >= 0 (at most budget: a fixed budget), "
                             f"got {self.max_budget}")
        if self.global_budget is not None and self.global_budget < 0:
            raise ValueError(f"PrefetchConfig.global_budget must be >= 0, got {self.global_budget}")
        if not 0.0 <= self.min_probability <= 1.0:
            raise ValueError(f"PrefetchConfig.min_probability must be in [0, 1], got {self.min_probability}")
        if not 0.0 <= self.plan_floor <= 1.0:
            raise ValueError(f"PrefetchConfig.plan_floor must be in [0, 1], got {self.plan_floor}")
        if self.levels < 1:
            raise ValueError(f"PrefetchConfig.levels must be >= 1, got {self.levels}")
        if not 0.0 < self.calibration_decay <= 1.0:
            raise ValueError(f"PrefetchConfig.calibration_decay must be in (0, 1], got {self.calibration_decay}")
        if self.prior_strength <= 0:
            raise ValueError(f"PrefetchConfig.prior_strength must be > 0, got {self.prior_strength}")


PREFETCH_MODES = ("auto", "on", "off")
MODEL_DTYPES = ("float32", "bfloat16", "float16")
ENGINE_DTYPES = ("auto", *MODEL_DTYPES)  # auto: what the engine's device computes fast in


@dataclass
class EngineConfig:
    """How the engine proposer spends verification."""

    adaptive_length: bool = True       # cut drafts where verifying costs more than it saves
    cost_decay: float = 0.98           # forgetting factor of the online step-time fit
    explore_every: int = 16            # while drafting is off, every n-th step verifies a few tokens (cost probe),
    explore_max_every: int = 256       # ... the interval doubling after each probe that finds it still does not pay
    min_gain: float = 0.1              # drafts must raise the expected throughput by this much (estimates err)
    draft_threads: int | str = "auto"  # threads the batched drafting core spreads a step's rows over, or
    #                                    "auto": an accelerator engine's share of the host's cores less one, at
    #                                    most 8; 1 on a CPU (engine.vllm_proposer.draft_thread_count)
    prefetch: str | bool = "auto"      # look up likely next drafts while the forward runs: "on", "off", or
    #                                    "auto": on where the forward leaves CPU cores idle (an accelerator,
    #                                    or spare cores); off where it runs on every core (it would slow it)

    def __post_init__(self) -> None:
        check_types(self)
        if isinstance(self.prefetch, bool):  # true / false (older configs; YAML reads a bare on / off so)
            self.prefetch = "on" if self.prefetch else "off"
        if self.prefetch not in PREFETCH_MODES:
            raise ValueError(f"EngineConfig.prefetch must be one of {PREFETCH_MODES}, got {self.prefetch!r}")
        if not 0.0 < self.cost_decay <= 1.0:
            raise ValueError(f"EngineConfig.cost_decay must be in (0, 1], got {self.cost_decay}")
        if self.min_gain < 0:
            raise ValueError(f"EngineConfig.min_gain must be >= 0, got {self.min_gain}")
        if self.draft_threads != "auto" and (isinstance(self.draft_threads, str) or self.draft_threads < 1):
            raise ValueError(f"EngineConfig.draft_threads must be an integer >= 1 or \"auto\", "
                             f"got {self.draft_threads!r}")
        if self.explore_every < 1:
            raise ValueError(f"EngineConfig.explore_every must be >= 1, got {self.explore_every}")
        if self.explore_max_every < self.explore_every:
            raise ValueError(f"EngineConfig.explore_max_every must be >= explore_every ({self.explore_every}), "
                             f"got {self.explore_max_every}")


@dataclass
class NgramRLConfig:
    history: HistoryConfig = field(default_factory=HistoryConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
