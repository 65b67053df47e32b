"""GRPO's advantages and loss."""

import pytest
import torch

from ngramrl.pipeline.grpo import group_advantages, grpo_loss, token_logprobs


def test_advantages_are_normalised_per_group():
    adv = group_advantages([1.0, 0.0, 1.0, 0.0, 5.0, 5.0], ["a", "a", "a", "a", "b", "b"])
    assert adv[:4] == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-5)
    assert adv[4:] == [0.0, 0.0]  # a flat group teaches nothing
    with pytest.raises(ValueError):
        group_advantages([1.0], ["a", "b"])


def test_loss_raises_the_logprob_of_advantaged_tokens():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5))
    mask = torch.ones(2, 5)
    logp = token_logprobs(logits, targets)
    loss, metrics = grpo_loss(logp, logp.detach(), torch.tensor([1.0, -1.0]), mask, clip=0.2)
    loss.backward()
    step = logits - 0.5 * logits.grad
    after = token_logprobs(step, targets)
    assert (after[0] > logp[0]).all() and (after[1] < logp[1]).all()
    assert metrics["clip_fraction"] == 0.0


def test_clipping_stops_the_gradient_beyond_the_trust_region():
    logp = torch.tensor([[0.0]], requires_grad=True)
    old = torch.tensor([[-1.0]])  # ratio e > 1 + clip
    loss, metrics = grpo_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 1), clip=0.2)
    loss.backward()
    assert logp.grad.abs().item() == 0.0 and metrics["clip_fraction"] == 1.0


def test_kl_penalty_is_zero_at_the_reference_and_positive_away_from_it():
    logp = torch.tensor([[-1.0, -2.0]])
    mask = torch.ones(1, 2)
    _, same = grpo_loss(logp, logp, torch.tensor([0.0]), mask, 0.2, ref_logp=logp, kl_coef=0.1)
    _, away = grpo_loss(logp, logp, torch.tensor([0.0]), mask, 0.2, ref_logp=logp - 0.5, kl_coef=0.1)
    assert same["kl"] == pytest.approx(0.0) and away["kl"] > 0


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trainer_batches_score_each_output_token_exactly(tiny_model_dir, temperature):
    """Left padding plus logits_to_keep gives the same log-probabilities as one unpadded sequence,
    those of the policy that sampled the rollouts: the softmax of logits / temperature."""
    from transformers import AutoModelForCausalLM

    from ngramrl.pipeline.config import ModelSection, TrainerSection
    from ngramrl.pipeline.trainer import PolicyTrainer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    trainer = PolicyTrainer(tiny_model_dir, ModelSection(path=tiny_model_dir), TrainerSection(), 3, 0,
                            temperature=temperature)
    trainer.torch, trainer.micro_batches, trainer.device = torch, 1, torch.device("cpu")
    samples = [{"prompt": [1, 5, 9, 12], "output": [30, 31, 32, 33, 34], "advantage": 1.0},
               {"prompt": [1, 7], "output": [40, 41], "advantage": -1.0},
               {"prompt": [1, 8, 8, 8, 8, 8, 8], "output": [], "advantage": 0.5}]
    batch, = trainer._batches(samples)
    with torch.no_grad():
        got = trainer._logprobs(model, batch)
        for i, sample in enumerate(samples):
            n = len(sample["output"])
            if not n:
                assert batch["mask"][i].sum() == 0
                continue
            ids = torch.tensor([sample["prompt"] + sample["output"]])
            logits = model(input_ids=ids).logits[0, len(sample["prompt"]) - 1:-1]
            chosen = torch.tensor(sample["output"]).unsqueeze(-1)
            want = torch.log_softmax(logits / temperature, -1).gather(-1, chosen).squeeze(-1)
            mask = batch["mask"][i].bool()
            assert mask.sum() == n
            assert torch.allclose(got[i][mask], want, atol=1e-4)
