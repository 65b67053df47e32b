"""Stand-ins for the parts of vLLM a proposer reads, to drive proposers without vLLM.

A ``custom_class`` proposer is built with vLLM's config and called once per engine step with the
tokens each row of the batch sampled; it reads the batch's request ids and each request's prompt,
output and sampling parameters from the model runner it is bound to. ``StandInRunner`` holds
exactly that, and ``standin_vllm_config`` the config fields the proposers read.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


class StandInRunner:
    """vLLM's model runner as a proposer sees it: ``input_batch.req_ids`` (the batch's rows in
    order) and ``requests[req_id]`` with ``sampling_params.extra_args``, ``prompt_token_ids`` and
    ``output_token_ids`` (the tokens generated so far, extended by whoever drives the steps)."""

    def __init__(self) -> None:
        self.input_batch = SimpleNamespace(req_ids=[])
        self.requests: dict[str, SimpleNamespace] = {}

    def add(self, req_id: str, prompt_id: str | None, prompt: list[int], epoch: int | None = None) -> SimpleNamespace:
        """A request joins the batch (as its last row). Its prompt id and epoch reach the proposer as
        ``extra_args`` the way ``SamplingParams(extra_args=...)`` carries them; None: a request without."""
        if req_id in self.requests:
            raise ValueError(f"request {req_id!r} is already in the batch")
        extra: dict[str, Any] = {} if prompt_id is None else {"prompt_id": prompt_id}
        if epoch is not None:
            extra["epoch"] = epoch
        request = SimpleNamespace(sampling_params=SimpleNamespace(extra_args=extra),
                                  prompt_token_ids=list(prompt), output_token_ids=[])
        self.requests[req_id] = request
        self.input_batch.req_ids.append(req_id)
        return request

    def remove(self, req_id: str) -> None:
        del self.requests[req_id]
        self.input_batch.req_ids.remove(req_id)


def standin_vllm_config(num_speculative_tokens: int, eos_token_ids: tuple[int, ...] = (),
                        max_model_len: int = 1 << 20, device_type: str = "cpu") -> SimpleNamespace:
    """The fields of vLLM's config that the proposers read."""
    eos: Any = list(eos_token_ids) if eos_token_ids else None
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=num_speculative_tokens),
                           model_config=SimpleNamespace(max_model_len=max_model_len,
                                                        hf_config=SimpleNamespace(eos_token_id=eos)),
                           device_config=SimpleNamespace(device_type=device_type))
