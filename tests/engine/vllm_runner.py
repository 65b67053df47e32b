"""Runs vLLM scenarios in a fresh process (vLLM binds threads and loads plugins once per process).

    python tests/engine/vllm_runner.py SPEC.json OUT.json

SPEC: {"model": dir, "draft": "none"|"ngramrl"|..., "k": 6, "epochs": [[request, ...], ...]} where a
request is {"prompt": [ids], "prompt_id": str|null, "temperature": float, "top_k": int, "top_p": float,
"seed": int|null, "max_tokens": int, "epoch": int}; "proposer" names another custom_class proposer and
"engine_args" are more vllm.LLM arguments; "perturb_seed" loads the model's weights plus seeded noise
through the worker extension (a weight sync) before the first epoch, and "logprobs" returns each
output token's log-probability. Each epoch is one generate call; OUT holds the outputs per epoch
and vLLM's speculative decoding counters. With "restart": "restored" | "cold", the engine is shut
down before the last epoch and a new one runs it, given the old proposer's exported state or not
(the counters are then the new engine's; OUT also holds what ``restore_state`` returned). With
"record_drafts", OUT also holds, for each engine step, what the ngramrl proposer was given and returned, as
[[request number, tokens sampled, draft], ...] (vLLM's request ids carry a random suffix after
the number). With "thread_cores", OUT also holds the proposer's stats_dict() and, per process this
one started (vLLM's engine core and workers, by name), the cores each of its threads may run on.
With "rank_stats", OUT also holds every worker's answer to ngramrl_stats, in rank order.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    from ngramrl.engine.rollouts import PROPOSER, RolloutEngineConfig
    from ngramrl.engine.worker_extension import EXTENSION

    spec = json.load(open(spec_path))
    drafts: list[list] = []
    if spec.get("record_drafts"):
        record_drafts(drafts)
    if spec.get("ngramrl_config"):
        from ngramrl.engine.vllm_proposer import CONFIG_ENV

        os.environ[CONFIG_ENV] = json.dumps(spec["ngramrl_config"])
    config = RolloutEngineConfig(model=spec["model"], draft=spec.get("draft", "ngramrl"),
                                 num_speculative_tokens=spec.get("k", 6),
                                 max_model_len=spec.get("max_model_len", 256),
                                 proposer=spec.get("proposer", PROPOSER))
    kwargs = dict(model=config.model, dtype=spec.get("dtype", "bfloat16"), max_model_len=config.max_model_len, seed=0,
                  enforce_eager=True, disable_log_stats=False, worker_extension_cls=EXTENSION,
                  **spec.get("engine_args", {}))
    if config.speculative_config():
        kwargs["speculative_config"] = config.speculative_config()
    llm = LLM(**kwargs)
    if spec.get("perturb_seed") is not None:  # new policy weights, as the trainer sends them
        llm.collective_rpc("ngramrl_load_weights", args=(perturbed_weights(spec),))
        llm.reset_prefix_cache()
    results, restored, logprobs = [], None, []
    for number, requests in enumerate(spec["epochs"]):
        if spec.get("restart") and number == len(spec["epochs"]) - 1:
            state = llm.collective_rpc("ngramrl_export_state")[0]
            llm.llm_engine.engine_core.shutdown()
            llm = LLM(**kwargs)
            if spec["restart"] == "restored":
                restored = llm.collective_rpc("ngramrl_restore_state", args=(state,))[0]
        params = []
        for r in requests:
            extra = {} if r.get("prompt_id") is None else {"prompt_id": r["prompt_id"], "epoch": r.get("epoch", 0)}
            params.append(SamplingParams(temperature=r.get("temperature", 0.0), top_k=r.get("top_k", -1),
                                         top_p=r.get("top_p", 1.0), seed=r.get("seed"),
                                         max_tokens=r.get("max_tokens", 32), extra_args=extra or None,
                                         logprobs=0 if spec.get("logprobs") else None))
        outs = llm.generate([{"prompt_token_ids": r["prompt"]} for r in requests], params, use_tqdm=False)
        if spec.get("end_batch"):  # as RolloutEngine.generate does
            llm.collective_rpc("ngramrl_end_batch")
        results.append([list(o.outputs[0].token_ids) for o in outs])
        if spec.get("logprobs"):
            logprobs.append([[step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids,
                                                                   strict=True)] for o in outs])
    threads = {}
    if spec.get("thread_cores"):
        threads = {"stats": llm.collective_rpc("ngramrl_stats")[0], "processes": descendant_thread_cores()}
    rank_stats = llm.collective_rpc("ngramrl_stats") if spec.get("rank_stats") else None
    history = None
    if spec.get("history"):  # the proposer's counters and the rollouts it stored
        state = llm.collective_rpc("ngramrl_export_state")[0]
        history = {"stats": llm.collective_rpc("ngramrl_stats")[0],
                   "rollouts": {prompt_id: [output for _, output in rollouts]
                                for prompt_id, _, rollouts in state["history"]}}
    metrics = {m.name: float(m.value) for m in llm.get_metrics()
               if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value")}
    json.dump({"outputs": results, "metrics": metrics, "restored": restored, "logprobs": logprobs,
               "drafts": drafts, "threads": threads, "history": history, "rank_stats": rank_stats},
              open(out_path, "w"))


def descendant_thread_cores() -> dict[str, list[str]]:
    """For each process this one started (by name), the Cpus_allowed_list of each of its threads."""

    def status(path: str, key: str) -> str:
        with open(path) as handle:
            return next(line.split()[1] for line in handle if line.startswith(key))

    def descends(pid: int) -> bool:
        while pid > 1:
            if pid == os.getpid():
                return True
            pid = int(status(f"/proc/{pid}/status", "PPid:"))
        return False

    found: dict[str, list[str]] = {}
    for entry in os.listdir("/proc"):
        try:
            if not entry.isdigit() or int(entry) == os.getpid() or not descends(int(entry)):
                continue
            with open(f"/proc/{entry}/comm") as handle:
                name = handle.read().strip()
            for task in os.listdir(f"/proc/{entry}/task"):
                found.setdefault(name, []).append(status(f"/proc/{entry}/task/{task}/status", "Cpus_allowed_list:"))
        except (OSError, StopIteration):
            continue  # the process or thread ended
    return found


def record_drafts(steps: list[list]) -> None:
    """Append each step's sampled tokens and drafts to ``steps`` (the engine runs in this process)."""
    from ngramrl.engine.vllm_proposer import NgramRLProposer

    propose = NgramRLProposer.propose

    def recorded(self, sampled_token_ids, *args, **kwargs):
        drafts = propose(self, sampled_token_ids, *args, **kwargs)
        req_ids = self.runner.input_batch.req_ids[:len(sampled_token_ids)] if self.runner is not None else []
        steps.append([[req_id.split("-")[0], list(sampled), list(draft)]
                      for req_id, sampled, draft in zip(req_ids, sampled_token_ids, drafts, strict=False)])
        return drafts

    NgramRLProposer.propose = recorded


def perturbed_weights(spec: dict) -> dict:
    """The model's weights plus seeded noise, by Hugging Face name, in the engine's dtype."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    generator = torch.Generator().manual_seed(spec["perturb_seed"])
    dtype = getattr(torch, spec.get("dtype", "bfloat16"))
    return {name: (tensor + 0.05 * tensor.std() * torch.randn(tensor.shape, generator=generator)).to(dtype)
            for name, tensor in model.state_dict().items()}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
