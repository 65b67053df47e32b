#!/usr/bin/env bash
# OpenRLHF GRPO on a 4-node x 8-GPU Ray cluster with ngramrl drafting: actor, reference, reward model and
# the 32 vLLM engines share the 32 GPUs (vLLM and DeepSpeed sleep in turn). Start the cluster first:
#   head:    bash train_scripts/ray_cluster.sh head
#   workers: HEAD_ADDR=<head ip> bash train_scripts/ray_cluster.sh worker
# then run this on the head node. Extra arguments go to OpenRLHF (or to ngramrl as --ngramrl.*).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=/dev/null
source ray_configs/cluster.env
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH  # the cluster refuses requests without its token
MODEL=${MODEL:-OpenRLHF/Llama-3-8b-sft-mixture}
DATA=${DATA:-OpenRLHF/prompt-collection-v0.1}
REWARD=${REWARD:-OpenRLHF/Llama-3-8b-rm-700k}   # of the policy's tokenizer (it scores the policy's token ids);
                                               # or pass --reward.remote_url / --train.agent_func_path
SAVE=${SAVE:-/shared/checkpoint/llama3-8b-grpo-ngramrl}   # a directory every node can write

exec ray job submit --address "http://$DASHBOARD_HOST:$DASHBOARD_PORT" \
  --runtime-env ray_configs/runtime_env.yaml \
  -- python3 -m ngramrl.openrlhf \
  --actor.model_name_or_path "$MODEL" \
  --data.prompt_dataset "$DATA" --data.input_key context_messages --data.apply_chat_template \
  --reward.model_name_or_path "$REWARD" \
  --actor.num_nodes 4 --actor.num_gpus_per_node 8 --ref.num_nodes 4 --ref.num_gpus_per_node 8 \
  --vllm.num_engines 32 --vllm.tensor_parallel_size 1 --vllm.gpu_memory_utilization 0.6 \
  --train.colocate_all --vllm.enable_sleep --ds.enable_sleep \
  --algo.advantage.estimator group_norm --rollout.n_samples_per_prompt 8 \
  --rollout.batch_size 512 --train.batch_size 4096 --rollout.max_new_tokens 2048 --data.max_len 4096 \
  --ds.zero_stage 3 --ds.param_dtype bf16 --actor.gradient_checkpointing_enable \
  --ckpt.output_dir "$SAVE" \
  --logger.wandb.project ngramrl-openrlhf ${WANDB_API_KEY:+--logger.wandb.key "$WANDB_API_KEY"} \
  --ngramrl.num_speculative_tokens 16 --ngramrl.shards 32 --ngramrl.prefetch_budget 16 \
  --ngramrl.save_dir "$SAVE/ngramrl_pool" "$@"
