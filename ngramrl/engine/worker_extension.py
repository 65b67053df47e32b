"""Methods mixed into vLLM's workers (``LLM(worker_extension_cls=...)``), reached with
``llm.collective_rpc(name)`` whether the engine runs in-process or in its own processes."""

from __future__ import annotations

from typing import Any

EXTENSION = "ngramrl.engine.worker_extension.NgramRLWorkerExtension"


def _proposer(runner: Any) -> Any:
    """The runner's drafter where vLLM reads its drafts; None elsewhere: on the other tensor-parallel
    ranks an ngramrl proposer holds nothing (``NgramRLProposer.drafts_read``), and on the earlier
    pipeline stages there is no drafter."""
    drafter = getattr(runner, "drafter", None)
    return drafter if getattr(drafter, "drafts_read", True) else None


class NgramRLWorkerExtension:
    model_runner: Any  # provided by the vLLM worker this class is mixed into

    def ngramrl_stats(self) -> dict[str, Any] | None:
        """The ngramrl proposer's counters, or None when the engine drafts otherwise."""
        drafter = _proposer(self.model_runner)
        return drafter.stats_dict() if hasattr(drafter, "stats_dict") else None

    def ngramrl_export_state(self) -> dict[str, Any] | None:
        """What the proposer has learned (``NgramRLProposer.export_state``), or None."""
        drafter = _proposer(self.model_runner)
        return drafter.export_state() if hasattr(drafter, "export_state") else None

    def ngramrl_restore_state(self, state: dict[str, Any]) -> int | None:
        """Give the proposer an exported state; returns the prompts it knows, or None without one."""
        drafter = _proposer(self.model_runner)
        return drafter.restore_state(state) if hasattr(drafter, "restore_state") else None

    def ngramrl_new_batch(self, prompts: dict[str, list[int]] | None = None) -> None:
        """A new generate call starts, running ``prompts`` (id -> prompt tokens): the proposer may
        refresh what it knows (its copies of the drafter pool's history, restarted shards)."""
        drafter = _proposer(self.model_runner)
        if hasattr(drafter, "new_batch"):
            drafter.new_batch(prompts)

    def ngramrl_end_batch(self) -> None:
        """A generate call returned with every request done: the proposer stores them now
        (``NgramRLProposer.end_batch``). Only where no other request is in flight (``LLM.generate``)."""
        drafter = _proposer(self.model_runner)
        if hasattr(drafter, "end_batch"):
            drafter.end_batch()

    def ngramrl_load_weights(self, weights: dict[str, Any]) -> int:
        """Load new policy weights (HF parameter names) in place; returns how many tensors were given."""
        runner = self.model_runner
        if hasattr(runner, "reload_weights"):  # also redoes the kernels' weight repacking (CPU backends)
            runner.reload_weights(weights_iterator=list(weights.items()))
        else:
            runner.model.load_weights(weights=iter(weights.items()))
        return len(weights)

    def ngramrl_param_sums(self, names: list[str]) -> dict[str, float]:
        """Sums of the named parameters as the engine holds them (to check that weights arrived)."""
        params = dict(self.model_runner.model.named_parameters())
        return {name: float(params[name].detach().float().sum()) for name in names if name in params}
