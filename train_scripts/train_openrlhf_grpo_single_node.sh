#!/usr/bin/env bash
# OpenRLHF GRPO on one 8-GPU node with ngramrl drafting in its vLLM engines (OpenRLHF's own trainer).
# Every openrlhf.cli.train_ppo_ray argument works as usual; --ngramrl.* options configure ngramrl
# (--ngramrl.enable false runs plain OpenRLHF). Start Ray first: bash train_scripts/ray_cluster.sh head
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=/dev/null
source ray_configs/cluster.env
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH  # the cluster refuses requests without its token
MODEL=${MODEL:-OpenRLHF/Llama-3-8b-sft-mixture}
DATA=${DATA:-OpenRLHF/prompt-collection-v0.1}
REWARD=${REWARD:-OpenRLHF/Llama-3-8b-rm-700k}   # of the policy's tokenizer (it scores the policy's token ids);
                                               # or pass --reward.remote_url / --train.agent_func_path
# absolute: the job runs in Ray's copy of this directory, which Ray deletes
SAVE=${SAVE:-$PWD/checkpoint/llama3-8b-grpo-ngramrl}

exec ray job submit --address "http://$DASHBOARD_HOST:$DASHBOARD_PORT" \
  --runtime-env ray_configs/runtime_env.yaml \
  -- python3 -m ngramrl.openrlhf \
  --actor.model_name_or_path "$MODEL" \
  --data.prompt_dataset "$DATA" --data.input_key context_messages --data.apply_chat_template \
  --reward.model_name_or_path "$REWARD" \
  --actor.num_nodes 1 --actor.num_gpus_per_node 8 \
  --vllm.num_engines 8 --vllm.tensor_parallel_size 1 --vllm.gpu_memory_utilization 0.6 \
  --train.colocate_all --vllm.enable_sleep --ds.enable_sleep \
  --algo.advantage.estimator group_norm --rollout.n_samples_per_prompt 8 \
  --rollout.batch_size 128 --train.batch_size 1024 --rollout.max_new_tokens 1024 \
  --ds.zero_stage 3 --ds.param_dtype bf16 --actor.gradient_checkpointing_enable \
  --ckpt.output_dir "$SAVE" \
  --logger.wandb.project ngramrl-openrlhf ${WANDB_API_KEY:+--logger.wandb.key "$WANDB_API_KEY"} \
  --ngramrl.num_speculative_tokens 16 --ngramrl.shards 8 --ngramrl.prefetch_budget 16 \
  --ngramrl.save_dir "$SAVE/ngramrl_pool" "$@"
