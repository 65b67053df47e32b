"""The DeepSpeed trainer with two ranks for real (Ray actors, gloo on CPU): ZeRO-2 and ZeRO-3 (with
two updates per step), a step in which one rank's samples carry no signal, then one in which no
rank's do, weights that stay identical on both ranks."""

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("deepspeed")
torch = pytest.importorskip("torch")

from ngramrl.pipeline.config import ModelSection, TrainerSection  # noqa: E402
from ngramrl.pipeline.trainer import PolicyTrainer  # noqa: E402

WAIT_S = 300  # a rank left waiting in a collective hangs; the test fails instead


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, namespace="ngramrl-test-trainer")
    yield
    ray.shutdown()


def samples(advantages):
    return [{"prompt": [1, 5, 9, 12], "output": [20 + i, 30 + i, 40 + i], "advantage": a}
            for i, a in enumerate(advantages)]


class Ranks:
    def __init__(self, ranks, address):
        self.ranks, self.address = ranks, address


def start_ranks(model_dir, trainer_section, resume_optimizer):
    remote = ray.remote(num_cpus=0)(PolicyTrainer)
    ranks = [remote.remote(str(model_dir), ModelSection(path=str(model_dir)), trainer_section, 4, 0, rank, 2,
                           resume_optimizer=resume_optimizer) for rank in range(2)]
    return Ranks(ranks, ray.get(ranks[0].rendezvous.remote(), timeout=WAIT_S))


@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_step_together_when_one_rank_has_no_signal(cluster, tiny_model_dir, stage, tmp_path):
    # Two updates per step under ZeRO-3: the rank without signal must still join the forwards that
    # score the other rank's samples before the first update (each gathers the parameters).
    trainer_section = TrainerSection(num_actors=2, zero_stage=stage, learning_rate=1e-2, micro_batch_size=2,
                                     threads=1, updates_per_step=2 if stage == 3 else 1)
    remote = ray.remote(num_cpus=0)(PolicyTrainer)
    ranks = [remote.remote(tiny_model_dir, ModelSection(path=tiny_model_dir), trainer_section, 4, 0, rank, 2)
             for rank in range(2)]
    try:
        master, port = ray.get(ranks[0].rendezvous.remote(), timeout=WAIT_S)
        ray.get([r.setup.remote(master, port) for r in ranks], timeout=WAIT_S)
        weights = ray.get([r.weights.remote("bfloat16") for r in ranks], timeout=WAIT_S)
        assert weights[1] is None
        names = sorted(weights[0])
        # every rank gathers
        before = ray.get([r.param_sums.remote(names, "bfloat16") for r in ranks], timeout=WAIT_S)[0]
        # rank 0 learns from two non-flat groups; every sample of rank 1 has zero advantage
        metrics = ray.get([ranks[0].train_step.remote(samples([1.0, -1.0, 0.5, -0.5])),
                           ranks[1].train_step.remote(samples([0.0, 0.0, 0.0, 0.0]))], timeout=WAIT_S)
        assert metrics[0]["trained_samples"] == 4 and metrics[1]["trained_samples"] == 0
        after = ray.get([r.param_sums.remote(names, "bfloat16") for r in ranks], timeout=WAIT_S)
        assert after[0] == after[1]                                  # both ranks hold the same policy
        assert any(after[0][n] != before[n] for n in before)        # and it moved
        weights = ray.get([r.weights.remote("bfloat16") for r in ranks], timeout=WAIT_S)
        full = {n: float(t.float().sum()) for n, t in weights[0].items()}
        for name, value in after[0].items():  # rank 0 hands out the whole, gathered policy
            assert full[name] == pytest.approx(value, rel=1e-3, abs=1e-3), name
        # Rank 0 saves the whole, gathered policy as a model that loads
        ray.get([r.save_policy.remote(str(tmp_path / "policy")) for r in ranks], timeout=WAIT_S)
        from transformers import AutoModelForCausalLM

        saved = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
        saved_sums = {n: float(t.detach().to(torch.bfloat16).float().sum()) for n, t in saved.state_dict().items()}
        for name, value in after[0].items():
            assert saved_sums[name] == pytest.approx(value, rel=1e-3, abs=1e-3), name
        # A step without signal on any rank leaves the policy as it was (AdamW's momentum would move it)
        metrics = ray.get([rank.train_step.remote(samples([0.0, 0.0, 0.0, 0.0])) for rank in ranks],
                          timeout=WAIT_S)
        assert [m["trained_samples"] for m in metrics] == [0, 0]
        assert ray.get([r.param_sums.remote(names, "bfloat16") for r in ranks], timeout=WAIT_S) == after
        # Ranks started from the saved policy with its optimizer state take the next step exactly as
        # the ranks that saved it; started from the policy alone (AdamW's moments at zero), not.
        resumed = start_ranks(tmp_path / "policy", trainer_section, resume_optimizer=True)
        fresh = start_ranks(tmp_path / "policy", trainer_section, resume_optimizer=False)
        ranks = [*ranks, *resumed.ranks, *fresh.ranks]  # all killed at the end
        assert ray.get([r.setup.remote(*resumed.address) for r in resumed.ranks], timeout=WAIT_S) == [None, None]
        ray.get([r.setup.remote(*fresh.address) for r in fresh.ranks], timeout=WAIT_S)
        sums = []
        for group in (ranks[:2], resumed.ranks, fresh.ranks):
            ray.get([group[0].train_step.remote(samples([1.0, -1.0, 0.5, -0.5])),
                     group[1].train_step.remote(samples([0.5, -0.5, 0.0, 0.0]))], timeout=WAIT_S)
            sums.append(ray.get(group[0].param_sums.remote(names, "bfloat16"), timeout=WAIT_S))
        assert sums[1] == sums[0]
        assert sums[2] != sums[0]
        # a state saved by another number of ranks does not load: the run is told why
        single = ray.remote(num_cpus=0)(PolicyTrainer).remote(
            str(tmp_path / "policy"), ModelSection(path=str(tmp_path / "policy")),
            TrainerSection(num_actors=1, zero_stage=stage, learning_rate=1e-2, micro_batch_size=2, threads=1),
            4, 0, 0, 1, resume_optimizer=True)
        ranks.append(single)
        why = ray.get(single.setup.remote(*ray.get(single.rendezvous.remote(), timeout=WAIT_S)), timeout=WAIT_S)
        assert why is not None and "did not load" in why
    finally:
        for rank in ranks:
            ray.kill(rank)


def test_under_zero3_the_kl_reference_is_sharded_and_its_forwards_keep_the_ranks_together(cluster, tiny_model_dir):
    """With a KL term each rank holds its shard of the reference, not a whole copy; a rank with
    fewer micro-batches still joins every reference forward (each gathers the shards)."""
    trainer_section = TrainerSection(num_actors=2, zero_stage=3, learning_rate=1e-2, micro_batch_size=2, threads=1,
                                     kl_coef=0.1, updates_per_step=2)
    group = start_ranks(tiny_model_dir, trainer_section, resume_optimizer=False)
    try:
        ray.get([r.setup.remote(*group.address) for r in group.ranks], timeout=WAIT_S)
        held = ray.get([r.__ray_call__.remote(lambda self: (
            sum(p.numel() for p in self.reference.module.parameters()),
            sum(p.ds_numel for p in self.reference.module.parameters()))) for r in group.ranks], timeout=WAIT_S)
        assert all(whole > 0 and here < whole / 2 for here, whole in held), held
        # rank 0: two micro-batches; rank 1: one, and one without samples
        metrics = ray.get([group.ranks[0].train_step.remote(samples([1.0, -1.0, 0.5, -0.5])),
                           group.ranks[1].train_step.remote(samples([0.5, -0.5]))], timeout=WAIT_S)
        assert metrics[0]["kl"] > 0 and [m["trained_samples"] for m in metrics] == [4, 2]
    finally:
        for rank in group.ranks:
            ray.kill(rank)
