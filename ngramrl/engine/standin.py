"""Stand-ins for the parts of vLLM a proposer reads, to drive proposers without vLLM.

A ``custom_class`` proposer is built with vLLM's config and called once per engine step with the
tokens each row of the batch sampled; it reads the batch's request ids and each request's prompt,
output and sampling parameters from the model runner it is bound to. ``StandInRunner`` holds
exactly that, and ``standin_vllm_config`` the config fields the proposers read.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


class StandInBatch:
    """vLLM's persistent input batch as far as its request ids go (``InputBatch``): a request that
    leaves frees its row, one that joins takes the lowest free row (else a new last row), and
    before a step is read the last rows move down into the rows still free (``condense``). Rows
    otherwise stay where they are from step to step, which the proposer relies on for speed."""

    def __init__(self) -> None:
        self._rows: list[str | None] = []
        self._free: list[int] = []

    @property
    def req_ids(self) -> list[str]:
        """The batch's rows in order, condensed (vLLM hands the proposer a condensed batch)."""
        self._free.sort()
        while self._free:
            while self._rows and self._rows[-1] is None:
                self._rows.pop()
            hole = self._free[0]
            if hole >= len(self._rows):
                self._free.clear()
                break
            self._free.pop(0)
            self._rows[hole] = self._rows.pop()
        return self._rows  # type: ignore[return-value]

    def add(self, req_id: str) -> None:
        if self._free:
            self._free.sort()
            self._rows[self._free.pop(0)] = req_id
        else:
            self._rows.append(req_id)

    def remove(self, req_id: str) -> None:
        row = self._rows.index(req_id)
        self._rows[row] = None
        self._free.append(row)


class StandInRunner:
    """vLLM's model runner as a proposer sees it: ``input_batch.req_ids`` (the batch's rows in
    order) and ``requests[req_id]`` with ``sampling_params.extra_args``, ``prompt_token_ids`` and
    ``output_token_ids`` (the tokens generated so far, extended by whoever drives the steps)."""

    def __init__(self) -> None:
        self.input_batch = StandInBatch()
        self.requests: dict[str, SimpleNamespace] = {}

    def add(self, req_id: str, prompt_id: str | None, prompt: list[int], epoch: int | None = None) -> SimpleNamespace:
        """A request joins the batch (in the lowest free row, else as its last row). Its prompt id
        and epoch reach the proposer as ``extra_args`` the way ``SamplingParams(extra_args=...)``
        carries them; None: a request without."""
        if req_id in self.requests:
            raise ValueError(f"request {req_id!r} is already in the batch")
        extra: dict[str, Any] = {} if prompt_id is None else {"prompt_id": prompt_id}
        if epoch is not None:
            extra["epoch"] = epoch
        request = SimpleNamespace(sampling_params=SimpleNamespace(extra_args=extra),
                                  prompt_token_ids=list(prompt), output_token_ids=[])
        self.requests[req_id] = request
        self.input_batch.add(req_id)
        return request

    def remove(self, req_id: str) -> None:
        """The request finished: it leaves the batch and the runner."""
        del self.requests[req_id]
        self.input_batch.remove(req_id)

    def preempt(self, req_id: str) -> None:
        """The request is not scheduled: it leaves the batch, the runner keeps it."""
        self.input_batch.remove(req_id)

    def resume(self, req_id: str) -> None:
        """A preempted request is scheduled again."""
        if req_id not in self.requests:
            raise ValueError(f"request {req_id!r} is not in the runner")
        self.input_batch.add(req_id)


def standin_vllm_config(num_speculative_tokens: int, eos_token_ids: tuple[int, ...] = (),
                        max_model_len: int = 1 << 20, device_type: str = "cpu",
                        generation_eos_token_ids: tuple[int, ...] = ()) -> SimpleNamespace:
    """The fields of vLLM's config that the proposers read (``generation_eos_token_ids``: those
    of the model's generation config)."""
    eos: Any = list(eos_token_ids) if eos_token_ids else None
    generation = {"eos_token_id": list(generation_eos_token_ids)} if generation_eos_token_ids else {}
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=num_speculative_tokens),
                           model_config=SimpleNamespace(max_model_len=max_model_len,
                                                        hf_config=SimpleNamespace(eos_token_id=eos),
                                                        try_get_generation_config=lambda: dict(generation)),
                           device_config=SimpleNamespace(device_type=device_type))
