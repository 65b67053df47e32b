"""The Ray training pipeline: drafter pool, rollout workers, GRPO trainer, the training loop."""
