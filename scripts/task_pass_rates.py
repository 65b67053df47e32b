"""How often SmolLM2-135M-Instruct solves reasoning-gym tasks before any training: the numbers behind
the main job's default task (docs/pipeline.md, "The default task").

    python scripts/task_pass_rates.py --prompts 16 --samples 8 --temperature 1.0

For each candidate (a reasoning-gym task with its difficulty settings) it samples ``--samples``
answers to each of ``--prompts`` problems with vLLM, scores them with the task's own checker, and
prints the pass rate, the share of problems whose samples disagree (GRPO learns only from those),
and the mean output length. A task RL can show learning on in minutes is one the model solves
sometimes: neither never (no signal) nor always (nothing to learn).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

CANDIDATES = {
    "basic_arithmetic-1d": ("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    "basic_arithmetic-2d": ("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}),
    "chain_sum-1d": ("chain_sum", {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}),
    "products-1d": ("products", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    "simple_equations": ("simple_equations", {}),
    "spell_backward": ("spell_backward", {}),
    "gsm_symbolic": ("gsm_symbolic", {}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", help="candidates to measure (default: all)")
    parser.add_argument("--json", help="also write the table as JSON here")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from ngramrl.data.models import prepare_smollm2
    from ngramrl.data.workloads import reasoning_gym_tasks
    from ngramrl.engine.rollouts import PromptSpec, RolloutEngine, RolloutEngineConfig
    from ngramrl.pipeline.rewards import reasoning_gym_reward

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    model = prepare_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(model)
    engine = RolloutEngine(RolloutEngineConfig(model=model, draft="none", max_model_len=1024,
                                               engine_args={"enforce_eager": True}))
    rows = []
    for name in args.only or list(CANDIDATES):
        task, settings = CANDIDATES[name]
        tasks = reasoning_gym_tasks(task, args.prompts, seed=args.seed, settings=settings)
        specs = [PromptSpec(t.prompt_id, list(tokenizer.apply_chat_template(
            t.messages, add_generation_prompt=True, tokenize=True, return_dict=False))) for t in tasks]
        rollouts = engine.generate(specs, n=args.samples, temperature=args.temperature, max_tokens=args.max_tokens,
                                   seed=args.seed)
        references = {t.prompt_id: t.reference for t in tasks}
        texts = tokenizer.batch_decode([r.output for r in rollouts], skip_special_tokens=True)
        scores = [reasoning_gym_reward(text, references[r.prompt_id]) for text, r in zip(texts, rollouts, strict=True)]
        groups: dict[str, list[float]] = {}
        for r, score in zip(rollouts, scores, strict=True):
            groups.setdefault(r.prompt_id, []).append(score)
        row = {"candidate": name, "task": task, "settings": settings, "pass_rate": statistics.fmean(scores),
               "mixed_groups": sum(len(set(g)) > 1 for g in groups.values()) / len(groups),
               "mean_tokens": statistics.fmean(len(r.output) for r in rollouts)}
        rows.append(row)
        print(f"{name:22s} pass {row['pass_rate']:.3f}  mixed groups {row['mixed_groups']:.2f}  "
              f"tokens {row['mean_tokens']:.0f}", flush=True)
    engine.close()
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"temperature": args.temperature, "prompts": args.prompts, "samples": args.samples,
                       "max_tokens": args.max_tokens, "candidates": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
