"""The baseline drafters as proposers with vLLM's calling convention.

``ngramrl.bench.steps`` drives proposers the way vLLM's model runner does: bound to a runner
(``ngramrl.engine.standin.StandInRunner``), called once per engine step with the tokens each row
sampled. ``NgramRLProposer`` is such a proposer already; these are SuffixDecoding (the real
arctic-inference cache, run as vLLM's ``suffix`` method runs it) and prompt lookup (vLLM's
``ngram`` method's algorithm), so every method is timed and verified through the same harness.
"""

from __future__ import annotations

from typing import Any

from ngramrl.bench.methods import SUFFIX_DEFAULTS, prompt_lookup
from ngramrl.core.trace import Rollout


def _context_tail(request: Any, length: int) -> list[int]:
    """The last ``length`` tokens of a request's prompt and output."""
    output = request.output_token_ids
    if len(output) >= length:
        return output[-length:]
    return request.prompt_token_ids[-(length - len(output)):] + output


class SuffixProposer:
    """SuffixDecoding (arctic-inference) as vLLM's ``suffix`` method runs it: one cache for all
    requests; a request's prompt builds its tree when it first appears, its sampled tokens are
    appended every step, the draft is speculated from the context's last ``max_tree_depth``
    tokens, and a request that left the batch is stopped (its response stays cached for later
    requests). ``add_history`` caches earlier rollouts the same way."""

    name = "suffix"

    def __init__(self, num_speculative_tokens: int, max_tree_depth: int = SUFFIX_DEFAULTS["max_tree_depth"],
                 max_spec_factor: float = SUFFIX_DEFAULTS["max_spec_factor"],
                 min_token_prob: float = SUFFIX_DEFAULTS["min_token_prob"], max_cached_requests: int = -1) -> None:
        try:
            from arctic_inference.suffix_decoding import SuffixDecodingCache
        except ImportError as err:
            raise RuntimeError("method 'suffix' needs arctic-inference (SuffixDecoding's package; the [suffix] "
                               "extra)") from err
        self.k = num_speculative_tokens
        self.depth = max_tree_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.cache = SuffixDecodingCache(max_tree_depth=max_tree_depth, max_cached_requests=max_cached_requests)
        self.runner: Any = None
        self._active: set[str] = set()
        self._history = 0

    def bind_runner(self, runner: Any) -> None:
        self.runner = runner

    def add_history(self, rollouts: list[Rollout]) -> None:
        for rollout in rollouts:
            self._history += 1
            key = f"history/{self._history}"
            self.cache.start_request(key, rollout.prompt)
            if rollout.output:
                self.cache.add_active_response(key, rollout.output)
            self.cache.stop_request(key)

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any, token_ids_cpu: Any,
                slot_mappings: Any = None) -> list[list[int]]:
        runner = self.runner
        req_ids = runner.input_batch.req_ids
        drafts: list[list[int]] = []
        for row, sampled in enumerate(sampled_token_ids):
            if not sampled:
                drafts.append([])
                continue
            req_id = req_ids[row]
            request = runner.requests[req_id]
            if req_id not in self._active:
                self.cache.start_request(req_id, request.prompt_token_ids)
                self._active.add(req_id)
            self.cache.add_active_response(req_id, sampled)
            draft = self.cache.speculate(req_id, _context_tail(request, self.depth), max_spec_tokens=self.k,
                                         max_spec_factor=self.max_spec_factor, min_token_prob=self.min_token_prob)
            drafts.append(list(draft.token_ids))
        for req_id in self._active - set(req_ids):
            self.cache.stop_request(req_id)
            self._active.discard(req_id)
        return drafts


class PromptLookupProposer:
    """Prompt lookup as vLLM's ``ngram`` method drafts (``prompt_lookup_min`` 2, ``max`` 5): the
    longest suffix n-gram of the request's own context seen earlier in it, and what followed."""

    name = "pld"

    def __init__(self, num_speculative_tokens: int, min_ngram: int = 2, max_ngram: int = 5) -> None:
        self.k = num_speculative_tokens
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.runner: Any = None

    def bind_runner(self, runner: Any) -> None:
        self.runner = runner

    def add_history(self, rollouts: list[Rollout]) -> None:
        pass  # it reads only the request's own context

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any, token_ids_cpu: Any,
                slot_mappings: Any = None) -> list[list[int]]:
        runner = self.runner
        drafts: list[list[int]] = []
        for row, sampled in enumerate(sampled_token_ids):
            if not sampled:
                drafts.append([])
                continue
            request = runner.requests[runner.input_batch.req_ids[row]]
            context = request.prompt_token_ids + request.output_token_ids
            drafts.append(prompt_lookup(context, self.min_ngram, self.max_ngram, self.k))
        return drafts
