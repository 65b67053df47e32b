"""Runs vLLM scenarios in a fresh process (vLLM binds threads and loads plugins once per process).

    python tests/engine/vllm_runner.py SPEC.json OUT.json

SPEC: {"model": dir, "draft": "none"|"ngramrl"|..., "k": 6, "epochs": [[request, ...], ...]} where a
request is {"prompt": [ids], "prompt_id": str|null, "temperature": float, "top_k": int, "seed": int|null,
"max_tokens": int, "epoch": int}. Each epoch is one generate call; OUT holds the outputs per epoch
and vLLM's speculative decoding counters.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    from ngramrl.engine.rollouts import RolloutEngineConfig

    spec = json.load(open(spec_path))
    if spec.get("ngramrl_config"):
        from ngramrl.engine.vllm_proposer import CONFIG_ENV

        os.environ[CONFIG_ENV] = json.dumps(spec["ngramrl_config"])
    config = RolloutEngineConfig(model=spec["model"], draft=spec.get("draft", "ngramrl"),
                                 num_speculative_tokens=spec.get("k", 6),
                                 max_model_len=spec.get("max_model_len", 256))
    kwargs = dict(model=config.model, dtype=spec.get("dtype", "bfloat16"), max_model_len=config.max_model_len, seed=0,
                  enforce_eager=True, disable_log_stats=False)
    if config.speculative_config():
        kwargs["speculative_config"] = config.speculative_config()
    llm = LLM(**kwargs)
    results = []
    for requests in spec["epochs"]:
        params = []
        for r in requests:
            extra = {} if r.get("prompt_id") is None else {"prompt_id": r["prompt_id"], "epoch": r.get("epoch", 0)}
            params.append(SamplingParams(temperature=r.get("temperature", 0.0), top_k=r.get("top_k", -1),
                                         seed=r.get("seed"), max_tokens=r.get("max_tokens", 32),
                                         extra_args=extra or None))
        outs = llm.generate([{"prompt_token_ids": r["prompt"]} for r in requests], params, use_tqdm=False)
        results.append([list(o.outputs[0].token_ids) for o in outs])
    metrics = {m.name: float(m.value) for m in llm.get_metrics()
               if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value")}
    json.dump({"outputs": results, "metrics": metrics}, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
