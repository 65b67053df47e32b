"""The fresh-prompts regime: every step samples new prompts, so no earlier epoch of a prompt exists
to draft from; the draft source is the prompt's G sibling samples, generated alongside.

Each (prompt, epoch) group of a trace is replayed on its own, its samples concurrently and step
by step, as an engine runs them: in every step each sample still running gets a draft from what
was known when the step began, then commits what verifying it would (the draft's longest prefix
equal to the recorded tokens, plus one token). Nothing from earlier epochs or other prompts is seen.

- ``ngramrl``: the prompt's index holds the prompt and every sibling's committed tokens (the
  engine's live sequences): a sibling's tokens of one step are visible from the next step on, and
  a finished sibling stays visible.
- ``suffix``: SuffixDecoding as vLLM runs it: each request's own tree over its prompt, and the
  shared tree of responses, which takes a running sibling's tokens as it commits them (the calls
  vLLM makes) and keeps a finished one's.
- ``pld``: prompt lookup, the request's own context only. ``none``: no drafts.
"""

from __future__ import annotations

import time
from itertools import groupby
from typing import Protocol

from ngramrl.bench.methods import prompt_lookup
from ngramrl.bench.replay import ReplayResult, accepted_prefix
from ngramrl.config import DrafterConfig, HistoryConfig
from ngramrl.core.drafter import NgramDrafter, RequestState
from ngramrl.core.history import RolloutHistory
from ngramrl.core.trace import Rollout, Trace

SIBLING_METHODS = ("ngramrl", "suffix", "pld", "none")


class SiblingMethod(Protocol):
    name: str

    def start_group(self, group: list[Rollout]) -> None: ...
    def propose(self, sample: int, k: int) -> list[int]: ...
    def commit(self, sample: int, tokens: list[int]) -> None: ...
    def end_step(self) -> None: ...
    def finish(self, sample: int) -> None: ...
    def end_group(self) -> None: ...


class NoSiblingDrafts:
    name = "none"

    def start_group(self, group: list[Rollout]) -> None:
        pass

    def propose(self, sample: int, k: int) -> list[int]:
        return []

    def commit(self, sample: int, tokens: list[int]) -> None:
        pass

    def end_step(self) -> None:
        pass

    def finish(self, sample: int) -> None:
        pass

    def end_group(self) -> None:
        pass


class NgramRLSiblings(NoSiblingDrafts):
    name = "ngramrl"

    def __init__(self, history: HistoryConfig | None = None, drafter: DrafterConfig | None = None) -> None:
        self.history_config = history or HistoryConfig()
        self.drafter_config = drafter or DrafterConfig()
        self.requests: dict[int, RequestState] = {}
        self.epoch = 0

    def start_group(self, group: list[Rollout]) -> None:
        self.drafter = NgramDrafter(RolloutHistory(self.history_config), self.drafter_config)
        self.epoch = group[0].epoch
        self.requests = {r.sample: self.drafter.start(f"{r.prompt_id}/{r.epoch}/{r.sample}", r.prompt_id, r.prompt,
                                                      register=True) for r in group}

    def propose(self, sample: int, k: int) -> list[int]:
        return self.drafter.lookup(self.requests[sample], k).tokens

    def commit(self, sample: int, tokens: list[int]) -> None:
        self.drafter.commit(self.requests[sample], tokens)

    def end_step(self) -> None:
        for request in self.requests.values():  # the step's tokens enter the index before the next step
            self.drafter.absorb(request)

    def finish(self, sample: int) -> None:
        self.drafter.finish(self.requests.pop(sample), epoch=self.epoch)  # a finished rollout: still visible


class SuffixSiblings(NoSiblingDrafts):
    name = "suffix"

    def __init__(self, max_tree_depth: int = 24, max_spec_factor: float = 1.0, min_token_prob: float = 0.1) -> None:
        try:
            from arctic_inference.suffix_decoding import SuffixDecodingCache
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise RuntimeError("method 'suffix' needs arctic-inference (see README: the [suffix] extra)") from err
        self.cache = SuffixDecodingCache(max_tree_depth=max_tree_depth, max_cached_requests=-1)
        self.depth, self.max_spec_factor, self.min_token_prob = max_tree_depth, max_spec_factor, min_token_prob
        self.contexts: dict[int, list[int]] = {}
        self.ids: dict[int, int] = {}
        self.finished: list[int] = []
        self._next_id = 0

    def start_group(self, group: list[Rollout]) -> None:
        for r in group:
            self._next_id += 1
            self.ids[r.sample] = self._next_id
            self.cache.start_request(self._next_id, r.prompt)
            self.contexts[r.sample] = list(r.prompt)

    def propose(self, sample: int, k: int) -> list[int]:
        draft = self.cache.speculate(self.ids[sample], self.contexts[sample][-self.depth:], max_spec_tokens=k,
                                     max_spec_factor=self.max_spec_factor, min_token_prob=self.min_token_prob)
        return list(draft.token_ids)

    def commit(self, sample: int, tokens: list[int]) -> None:
        self.contexts[sample].extend(tokens)
        self.cache.add_active_response(self.ids[sample], tokens)

    def finish(self, sample: int) -> None:
        request_id = self.ids.pop(sample)
        self.cache.stop_request(request_id)  # its response stays cached: visible to the siblings still running
        self.finished.append(request_id)
        del self.contexts[sample]

    def end_group(self) -> None:
        for request_id in self.finished:  # the next group is another prompt: it sees none of these
            self.cache.evict_cached_response(request_id)
        self.finished = []


class PromptLookupSiblings(NoSiblingDrafts):
    name = "pld"

    def __init__(self, min_ngram: int = 2, max_ngram: int = 5) -> None:
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.contexts: dict[int, list[int]] = {}

    def start_group(self, group: list[Rollout]) -> None:
        self.contexts = {r.sample: list(r.prompt) for r in group}

    def propose(self, sample: int, k: int) -> list[int]:
        return prompt_lookup(self.contexts[sample], self.min_ngram, self.max_ngram, k)

    def commit(self, sample: int, tokens: list[int]) -> None:
        self.contexts[sample].extend(tokens)


def make_sibling_method(name: str, drafter: DrafterConfig | None = None,
                        history: HistoryConfig | None = None) -> SiblingMethod:
    if name == "ngramrl":
        return NgramRLSiblings(history, drafter)
    if name == "suffix":
        return SuffixSiblings()
    if name == "pld":
        return PromptLookupSiblings()
    if name == "none":
        return NoSiblingDrafts()
    raise ValueError(f"method {name!r} has no siblings regime; choose from {', '.join(SIBLING_METHODS)}")


def replay_siblings(trace: Trace, method: SiblingMethod, k: int, trace_name: str | None = None) -> ReplayResult:
    """Replay every (prompt, epoch) group of ``trace`` with its samples concurrent (see the module)."""
    result = ReplayResult(trace_name or trace.path, trace.workload, method.name, k, regime="siblings")
    result.accepted_hist = [0] * (k + 1)
    clock = time.perf_counter_ns
    ordered = sorted(trace.rollouts, key=lambda r: (r.epoch, r.prompt_id, r.sample))
    for _, members in groupby(ordered, key=lambda r: (r.epoch, r.prompt_id)):
        group = [r for r in members if r.output]
        if not group:
            continue
        method.start_group(group)
        position = {r.sample: 0 for r in group}
        live = {r.sample: r for r in group}
        while live:
            begin = clock()
            # a first step is the prefill's forward: it samples the first token and verifies no
            # draft (an engine drafts from a sampled token on, as in replay)
            drafts = {sample: method.propose(sample, k) if position[sample] else [] for sample in live}
            for sample, rollout in list(live.items()):
                at = position[sample]
                accepted = accepted_prefix(drafts[sample][:k], rollout.output[at:])
                result.drafted += min(len(drafts[sample]), k)
                result.accepted += accepted
                committed = rollout.output[at:at + accepted + 1]
                method.commit(sample, committed)
                position[sample] = at + len(committed)
                result.forwards += 1
                result.accepted_hist[min(accepted, len(committed) - 1)] += 1
            method.end_step()
            for sample, rollout in list(live.items()):
                if position[sample] >= len(rollout.output):
                    method.finish(sample)
                    del live[sample]
                    result.tokens += len(rollout.output)
                    result.rollouts += 1
            result.step_ns.append((clock() - begin) // max(1, len(drafts)))
            result.cpu_ns.append(result.step_ns[-1])  # nothing runs in the background here
        method.end_group()
    return result
