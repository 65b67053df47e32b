"""The policy trainer: a DeepSpeed engine running GRPO on verified rollouts (a Ray actor).

CPU here (gloo, ``DS_ACCELERATOR=cpu``), GPUs elsewhere (nccl): the same code, other settings.
"""

from __future__ import annotations

import copy
import math
import os
import time
from typing import Any

from ngramrl.pipeline.config import ModelSection, TrainerSection

# In a saved policy's directory: DeepSpeed's checkpoint of the trainer (every rank's optimizer
# state, its fp32 weights under bf16), under one tag.
OPTIMIZER_DIR, OPTIMIZER_TAG = "optimizer", "state"


def _skip_shm_build() -> None:
    """Training on CPUs needs no shared-memory collectives: DeepSpeed uses its shm op only for
    inference all-reduce, and gloo reduces the gradients. Skip compiling it (75-95 s)."""
    import sys

    module = sys.modules.get("deepspeed.comm.torch")
    if module is not None and hasattr(module, "build_shm_op"):
        module.build_shm_op = lambda: None


class PolicyTrainer:
    """Create every rank, ask rank 0 for ``rendezvous()``, then call ``setup`` on all ranks at once.

    ``temperature``: the rollouts' sampling temperature. The policy that sampled them is the
    model's softmax of logits / temperature, so that is the policy whose log-probabilities the
    loss, its ratios and its KL term take (greedy rollouts, 0, are scored at 1). Top-p and top-k
    truncation are not applied to the log-probabilities (as in OpenRLHF and verl)."""

    def __init__(self, model_dir: str, model: ModelSection, trainer: TrainerSection, batch_per_rank: int, seed: int,
                 rank: int = 0, world_size: int = 1, temperature: float = 1.0, resume_optimizer: bool = False) -> None:
        self.args = (model_dir, model, trainer, batch_per_rank, seed, rank, world_size)
        self.rank = rank
        self.temperature = temperature if temperature > 0 else 1.0
        # a resumed run's trainers go on with the optimizer state saved beside its policy
        self.resume_optimizer = resume_optimizer

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port on it (rank 0 hosts the process group)."""
        import socket

        import ray

        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, master_addr: str, master_port: int) -> None:
        model_dir, model, trainer, batch_per_rank, seed, rank, world_size = self.args
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0",
                           "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)})
        on_cpu = trainer.num_gpus_per_actor <= 0
        if on_cpu:
            os.environ["DS_ACCELERATOR"] = "cpu"
        import torch

        torch.set_num_threads(trainer.threads or os.cpu_count() or 1)
        import deepspeed
        import deepspeed.comm.torch  # noqa: F401 - the module whose shm build is skipped below

        if on_cpu:
            _skip_shm_build()
        deepspeed.init_distributed(dist_backend=trainer.backend)
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.torch = torch
        self.config = trainer
        policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, model.train_dtype))
        policy.config.use_cache = False
        self.reference = None
        if trainer.kl_coef > 0:
            reference = copy.deepcopy(policy).eval()
            for parameter in reference.parameters():
                parameter.requires_grad_(False)
            if trainer.zero_stage == 3:
                # Sharded like the policy: a whole copy on every rank would be the model once more on
                # each GPU. Its forwards gather the shards, so every rank runs them together.
                reference, *_ = deepspeed.initialize(model=reference, config={
                    "train_micro_batch_size_per_gpu": trainer.micro_batch_size, "zero_optimization": {"stage": 3},
                    "bf16": {"enabled": trainer.precision == "bf16"}, "steps_per_print": 1 << 30})
                reference.eval()
            self.reference = reference
        self.micro_batches = max(1, math.ceil(batch_per_rank / trainer.micro_batch_size))
        ds_config = {
            "train_micro_batch_size_per_gpu": trainer.micro_batch_size,
            "gradient_accumulation_steps": self.micro_batches,
            "gradient_clipping": trainer.max_grad_norm,
            "zero_optimization": {"stage": trainer.zero_stage},
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": trainer.precision == "bf16"},
            "steps_per_print": 1 << 30,
        }
        optimizer = torch.optim.AdamW(policy.parameters(), lr=trainer.learning_rate, weight_decay=0.0)
        self.engine, *_ = deepspeed.initialize(model=policy, optimizer=optimizer, config=ds_config)
        self.device = self.engine.device
        if self.reference is not None and trainer.zero_stage != 3:  # DeepSpeed moved only its engines' modules
            self.reference.to(self.device)
        self.version = 0
        return self._load_optimizer(model_dir) if self.resume_optimizer else None

    def _load_optimizer(self, policy_dir: str) -> str | None:
        """The optimizer state saved with the policy in ``policy_dir`` (``save_policy``), loaded by
        every rank; None when it was, else why not (then AdamW starts afresh). A state saved by
        another number of ranks or ZeRO stage does not load."""
        path = os.path.join(policy_dir, OPTIMIZER_DIR)
        if not os.path.isdir(os.path.join(path, OPTIMIZER_TAG)):
            return f"{path} holds no optimizer state"
        try:
            loaded, _ = self.engine.load_checkpoint(path, tag=OPTIMIZER_TAG, load_optimizer_states=True,
                                                    load_lr_scheduler_states=False)
        except Exception as err:  # noqa: BLE001 - the run goes on from the policy alone, and says so
            return f"{path} did not load ({type(err).__name__}: {err})"
        if loaded is None:
            return f"{path} did not load"
        for group in self.engine.optimizer.param_groups:  # the saved state brings its run's learning rate
            group["lr"] = self.config.learning_rate
        return None

    def _batches(self, samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Left-padded micro-batches, so every output ends in the last column and the LM head runs
        only over the last ``keep`` positions (the ones that predict output tokens)."""
        torch = self.torch
        size = math.ceil(len(samples) / self.micro_batches)
        out = []
        for start in range(0, len(samples), size):
            chunk = samples[start:start + size]
            seqs = [list(s["prompt"]) + list(s["output"]) for s in chunk]
            width = max(map(len, seqs))
            keep = max(len(s["output"]) for s in chunk) + 1
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            attention = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros(len(chunk), keep - 1)
            for i, (sample, seq) in enumerate(zip(chunk, seqs, strict=True)):
                ids[i, width - len(seq):] = torch.tensor(seq)
                attention[i, width - len(seq):] = 1
                if sample["output"]:
                    mask[i, keep - 1 - len(sample["output"]):] = 1
            positions = (attention.cumsum(-1) - 1).clamp(min=0)
            out.append({"ids": ids.to(self.device), "attention": attention.to(self.device),
                        "positions": positions.to(self.device), "keep": keep, "mask": mask.to(self.device),
                        "advantages": torch.tensor([s["advantage"] for s in chunk], dtype=torch.float32,
                                                   device=self.device)})
        return out

    def _logprobs(self, model: Any, batch: dict[str, Any]) -> Any:
        from ngramrl.pipeline.grpo import token_logprobs

        keep = batch["keep"]
        logits = model(input_ids=batch["ids"], attention_mask=batch["attention"], position_ids=batch["positions"],
                       logits_to_keep=keep).logits
        if self.temperature != 1.0:
            logits = logits / self.temperature
        return token_logprobs(logits[:, :-1], batch["ids"][:, -(keep - 1):])

    def train_step(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        """One GRPO step on this rank's samples ({prompt, output, advantage}); returns its metrics.

        Without a KL term a sample with zero advantage adds exactly zero gradient, so it is not
        computed at all; each micro-batch's loss is scaled so the gradient is still the mean over
        every sample. Every rank runs the same number of forwards, backward passes and optimizer
        steps, whatever its samples (the gradient all-reduce, and under ZeRO-3 the parameter
        gathers, are collectives): a micro-batch with no signal is a zero loss over one token, which
        touches every parameter and adds nothing. A step in which no rank has a sample with signal
        makes no optimizer step at all: AdamW would still move the weights by its momentum."""
        from ngramrl.pipeline.grpo import grpo_loss

        torch = self.torch
        begin = time.perf_counter()
        total = len(samples)
        if self.config.kl_coef == 0:
            samples = [s for s in samples if s["advantage"] != 0.0]
        if not self._any_rank_has(bool(samples)):
            self.version += 1
            return {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "trained_samples": 0.0,
                    "train_seconds": time.perf_counter() - begin, "policy_version": self.version}
        batches: list[dict[str, Any] | None] = self._batches(samples) if samples else []
        while len(batches) < self.micro_batches:  # DeepSpeed steps after a fixed number of micro-batches
            batches.append(None)
        on_policy = self.config.updates_per_step == 1  # the rollout policy is the one being updated
        with torch.no_grad():
            self.engine.eval()
            old = None if on_policy else [self._engine_logprobs(b) for b in batches]
            ref = [self._reference_logprobs(b) for b in batches] if self.reference is not None else None
        self.engine.train()
        losses, kls, clips = [], [], []
        for _ in range(self.config.updates_per_step):
            for i, batch in enumerate(batches):
                if batch is None:
                    self.engine.backward(self._zero_loss())
                    self.engine.step()
                    continue
                logp = self._logprobs(self.engine, batch)
                behaviour = logp.detach() if old is None else old[i]
                loss, metrics = grpo_loss(logp, behaviour, batch["advantages"], batch["mask"], self.config.clip,
                                          ref[i] if ref is not None else None, self.config.kl_coef)
                share = len(batch["advantages"]) / total  # this micro-batch's part of the mean over all samples
                self.engine.backward(loss * share * self.micro_batches)
                self.engine.step()
                losses.append(loss.item() * share)
                kls.append(metrics["kl"] * share)
                clips.append(metrics["clip_fraction"] * share)
        self.version += 1
        passes = self.config.updates_per_step
        return {"loss": sum(losses) / passes, "kl": sum(kls) / passes, "clip_fraction": sum(clips) / passes,
                "trained_samples": float(len(samples)), "train_seconds": time.perf_counter() - begin,
                "policy_version": self.version}

    def _any_rank_has(self, signal: bool) -> bool:
        """Whether any rank has ``signal`` (every rank calls it: an all-reduce)."""
        import deepspeed.comm as dist

        flag = self.torch.tensor([1.0 if signal else 0.0], device=self.device)
        dist.all_reduce(flag)
        return bool(flag.item() > 0)

    def _engine_logprobs(self, batch: dict[str, Any] | None) -> Any:
        """The policy's log-probabilities of ``batch``; for no batch, a forward of one token all the
        same (under ZeRO-3 each forward gathers the parameters with the other ranks) and None."""
        if batch is not None:
            return self._logprobs(self.engine, batch)
        self._zero_loss()
        return None

    def _reference_logprobs(self, batch: dict[str, Any] | None) -> Any:
        """The reference's log-probabilities of ``batch``; for no batch None, after a forward of one
        token under ZeRO-3 (its forwards gather its shards with the other ranks')."""
        if batch is not None:
            return self._logprobs(self.reference, batch)
        if self.config.zero_stage == 3:
            self._one_token_logits(self.reference)
        return None

    def _zero_loss(self) -> Any:
        """A loss of exactly zero whose backward reaches every parameter (one token through the model)."""
        return self._one_token_logits(self.engine).sum() * 0.0

    def _one_token_logits(self, model: Any) -> Any:
        """A forward of one token through ``model`` (under ZeRO-3 it gathers the shards with the
        other ranks, whose forwards it matches)."""
        token = self.torch.zeros(1, 1, dtype=self.torch.long, device=self.device)
        return model(input_ids=token, attention_mask=self.torch.ones_like(token)).logits

    def _gathered(self, params: list[Any]) -> Any:
        """A context in which ``params`` are whole on this rank. Under ZeRO-3 each rank holds a
        shard and gathering is a collective: every rank must enter it, in the same order."""
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, enabled=self.config.zero_stage == 3)

    def param_sums(self, names: list[str], dtype: str) -> dict[str, float]:
        """Sums of the named parameters in the engines' dtype (compared with the engines' copies).
        Every rank calls it (a collective under ZeRO-3)."""
        as_engine = getattr(self.torch, dtype)
        named = dict(self.engine.module.named_parameters())
        chosen = [(name, named[name]) for name in names if name in named]
        with self._gathered([param for _, param in chosen]):
            return {name: float(param.detach().to(as_engine).float().sum()) for name, param in chosen}

    def save_policy(self, path: str) -> None:
        """Write the policy (HF format, the trainer's dtype) to ``path`` from rank 0: a directory the
        driver reads too, as the drafter pool's snapshots are; with ``save_optimizer``, each rank's
        optimizer state beside it (``OPTIMIZER_DIR``). Every rank calls it (a collective under ZeRO-3)."""
        state = self._whole_state(None)
        if state is not None:
            self.engine.module.save_pretrained(path, state_dict=state)
        if self.config.save_optimizer:
            self.engine.save_checkpoint(os.path.join(path, OPTIMIZER_DIR), tag=OPTIMIZER_TAG, save_latest=False)

    def weights(self, dtype: str) -> dict[str, Any] | None:
        """The policy's weights in the engines' dtype, by HF name (what vLLM's load_weights takes),
        on rank 0; None on the others. Every rank calls it (a collective under ZeRO-3)."""
        return self._whole_state(getattr(self.torch, dtype))

    def _whole_state(self, dtype: Any) -> dict[str, Any] | None:
        """The policy's state dict, whole, on the CPU in ``dtype`` (None: as trained), on rank 0;
        None on the others. Every rank calls it (a collective under ZeRO-3)."""
        module = self.engine.module
        with self._gathered(list(module.parameters())):
            if self.rank != 0:
                return None
            return {name: tensor.detach().to("cpu", dtype).clone() for name, tensor in module.state_dict().items()}
