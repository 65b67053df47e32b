"""The training loop: rollouts with ngramrl on Ray, rewards, GRPO with DeepSpeed, weight sync.

    result = train(load_config("ray_configs/cpu_default.yaml"))

Each step samples ``prompts_per_step`` prompts (revisiting the workload's prompts, so their
history warms), generates ``samples_per_prompt`` rollouts of each on the rollout workers, adds
them to the drafter pool, scores them, trains the policy on them and sends the new weights to
the workers. The history is not flushed when the policy changes: its bounded window keeps it fresh.
The trained policy is saved in the run directory (``policy/``) at the end, every
``run.save_policy_every`` steps and on Ctrl-C; a resumed run trains on from it.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from ngramrl.core.trace import Rollout, TraceHeader, TraceWriter, model_vocab_size, read_trace
from ngramrl.data.models import resolve_model
from ngramrl.engine.rollouts import PromptSpec
from ngramrl.pipeline.config import ConfigError, TrainConfig, load_reward
from ngramrl.pipeline.grpo import group_advantages
from ngramrl.pipeline.metrics import draft_rates, ratio
from ngramrl.pipeline.pool import DrafterPool
from ngramrl.pipeline.report import write_report
from ngramrl.pipeline.rewards import reward
from ngramrl.pipeline.rundir import (
    METRICS_FILE,
    POLICY_DIR,
    POLICY_FILE,
    POOL_DIR,
    SUMMARY_FILE,
    TRACE_FILE,
    EarlierRun,
    check_same_prompts,
    plan_run_dir,
)
from ngramrl.pipeline.tracking import Tracker

logger = logging.getLogger(__name__)


@dataclass
class StepRecord:
    step: int
    reward: float
    reward_std: float
    loss: float
    kl: float
    clip_fraction: float
    rollout_seconds: float
    train_seconds: float
    sync_seconds: float
    tokens: int
    tokens_per_forward: float | None  # committed tokens per target forward (vLLM's counters); None: none ran
    # ngramrl's own measures; None (absent from the metrics) where the run drafts another way or
    # does not prefetch, rather than numbers that read as "nothing offered, nothing covered".
    offered_tokens_per_forward: float | None  # what whole drafts would have given (the cost model may verify less)
    acceptance: float | None       # accepted / drafted tokens; None where nothing was verified
    coverage: float | None         # lookups whose draft the prefetch had ready / lookups
    drafter_ms_per_step: float | None  # the proposer's time per engine step
    pool_unsynced_prompts: int     # prompts that drafted from an engine's old copy: their shard was down
    pool_restarts: int
    pool_healthy: int
    trained_samples: int = 0        # samples that carried a learning signal (non-flat groups, or any with KL)
    weight_sync_error: float = 0.0  # largest relative gap between trainer and engine weights (checked each step)
    policy_checksum: float = 0.0    # sum of the trainer's embedding weights after the step

    def line(self) -> str:
        return (f"step {self.step:3d}  reward {self.reward:.3f}  loss {self.loss:+.4f}  kl {self.kl:.4f}  "
                f"tok/fwd {_shown(self.tokens_per_forward)} (offered {_shown(self.offered_tokens_per_forward)})  "
                f"accept {_shown(self.acceptance)}  coverage {_shown(self.coverage)}  "
                f"rollout {self.rollout_seconds:.1f}s ({self.tokens / max(self.rollout_seconds, 1e-9):.0f} tok/s)  "
                f"train {self.train_seconds:.1f}s ({self.trained_samples} samples)  "
                f"pool {self.pool_healthy} up, {self.pool_restarts} restarts")


def _shown(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


@dataclass
class TrainResult:
    steps: list[StepRecord]
    trace_path: str
    output_dir: str
    wandb_dir: str | None = None
    report_path: str | None = None  # report.png: reward, tokens per forward, rollout time, the trace's replay
    policy_path: str | None = None  # the trained policy (HF format)

    @property
    def rollouts(self) -> list[Rollout]:
        """The run's rollouts, read from its trace (a long run's do not stay in memory)."""
        return read_trace(self.trace_path).rollouts

    def summary(self) -> str:
        head = (f"{'step':>4} {'reward':>7} {'loss':>8} {'tok/fwd':>7} {'offered':>7} {'accept':>6} {'cover':>6} "
                f"{'rollout s':>9} {'tok/s':>6} {'train s':>7} {'unsynced':>8} {'restarts':>8}")
        rows = [head]
        for r in self.steps:
            rows.append(f"{r.step:>4} {r.reward:>7.3f} {r.loss:>+8.4f} {_shown(r.tokens_per_forward):>7} "
                        f"{_shown(r.offered_tokens_per_forward):>7} "
                        f"{_shown(r.acceptance):>6} {_shown(r.coverage):>6} {r.rollout_seconds:>9.1f} "
                        f"{r.tokens / max(r.rollout_seconds, 1e-9):>6.0f} {r.train_seconds:>7.1f} "
                        f"{r.pool_unsynced_prompts:>8d} {r.pool_restarts:>8d}")
        total = sum(r.rollout_seconds for r in self.steps)
        rows.append(f"rollout time {total:.1f}s over {len(self.steps)} steps; trace: {self.trace_path}")
        if self.report_path:
            rows.append(f"report: {self.report_path}")
        if self.policy_path:
            rows.append(f"policy: {self.policy_path}")
        return "\n".join(rows)



def _threads_env(threads: int) -> dict[str, Any]:
    """Ray limits an actor to as many OpenMP threads as CPUs it reserved (often 1): let the
    rollout and training phases, which alternate, use the cores they are given."""
    count = threads or os.cpu_count() or 1
    return {"env_vars": {"OMP_NUM_THREADS": str(count), "MKL_NUM_THREADS": str(count)}}


def driver_runtime_env() -> dict[str, Any]:
    """What ``train`` passes to ``ray.init`` for its actors. A Ray job's own runtime environment
    (ray_configs/runtime_env.yaml) may set none of these variables: Ray refuses the job if it does."""
    return {"env_vars": {"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
                         "TOKENIZERS_PARALLELISM": "false"}}


def _prompt_specs(config: TrainConfig, model_dir: str) -> tuple[list[PromptSpec], dict[str, Any]]:
    from transformers import AutoTokenizer

    from ngramrl.data.workloads import load_tasks

    workload = config.workload
    tasks = load_tasks(workload.name, workload.prompts, seed=workload.seed, spider_dir=workload.spider_dir,
                       task=workload.task, task_settings=workload.task_settings)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as err:
        raise ConfigError(f"model.path {config.model.path!r}: cannot load its tokenizer: {err}") from err
    specs, references = [], {}
    for task in tasks:
        ids = tokenizer.apply_chat_template(task.messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        if len(ids) + config.rollout.max_tokens > config.rollout.max_model_len:
            raise ValueError(f"prompt {task.prompt_id} has {len(ids)} tokens: with rollout.max_tokens "
                             f"{config.rollout.max_tokens} it exceeds rollout.max_model_len "
                             f"{config.rollout.max_model_len}")
        specs.append(PromptSpec(task.prompt_id, ids))
        references[task.prompt_id] = task.reference
    return specs, {"references": references, "tokenizer": tokenizer}


def _wait(ray: Any, refs: Any, what: str, timeout_s: float) -> Any:
    """``ray.get`` with a time limit; an error that names what did not finish."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(f"{what} did not finish within {timeout_s:.0f} s (run.timeout_s)") from None


def train(config: TrainConfig, before_rollout: Callable[[int, DrafterPool], None] | None = None) -> TrainResult:
    """Run ``config.run.steps`` RL steps; ``before_rollout(step, pool)`` runs just before a step's
    rollouts start (tests use it to inject faults the engines then meet). On KeyboardInterrupt
    (SIGINT) it saves the trace, metrics and drafter pool of the steps done, says so on stderr,
    and raises it on (``ngramrl train`` exits 130)."""
    import ray

    from ngramrl.pipeline.trainer import PolicyTrainer
    from ngramrl.pipeline.workers import RolloutWorker

    run, rollout = config.run, config.rollout
    plan = plan_run_dir(config)  # every output checked before anything starts
    config.check_local_gpus()
    # The model, the prompts and the reward load before the run directory is touched: a bad one
    # must not cost an --overwrite'n run its files, nor leave a config.json that refuses the retry.
    model_dir = resolve_model(config.model.path)
    prompts, extra = _prompt_specs(config, model_dir)
    references, tokenizer = extra["references"], extra["tokenizer"]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    score_fn = (load_reward(config.workload.reward) if config.workload.reward
                else functools.partial(reward, config.workload.name))
    vocab_size = model_vocab_size(model_dir, len(tokenizer))
    check_same_prompts(plan.earlier, {p.prompt_id: list(p.token_ids) for p in prompts}, vocab_size, eos,
                       run.output_dir)
    earlier = plan.prepare()
    output_dir = plan.path
    start_dir = _starting_policy(earlier, model_dir)
    with open(plan.config_file(), "w") as handle:
        json.dump(config.to_dict(), handle, indent=1)

    started_ray = False
    if not ray.is_initialized():
        needed = config.cpus_needed()
        kwargs: dict[str, Any] = {"namespace": config.ray.namespace, "include_dashboard": False}
        address = config.ray.address or os.environ.get("RAY_ADDRESS")  # the variable: a job's driver
        if address:
            kwargs["address"] = address
        else:
            # A private cluster of its own: without "local", Ray joins a cluster that `ray start`
            # left running on this machine (ray_cluster.sh's, for OpenRLHF), which refuses num_cpus.
            kwargs["address"] = "local"
            # Ray's CPU counts are scheduling tokens: ask for enough that every actor fits on a small machine.
            kwargs["num_cpus"] = config.ray.num_cpus or max(int(needed + 0.999), os.cpu_count() or 1)
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private local cluster: no token needed
        ray.init(runtime_env=driver_runtime_env(), **kwargs)
        started_ray = True
    tracker = Tracker(config.tracking, config.to_dict(), output_dir, append=plan.mode == "resume")
    pool = None
    pool_restored = False  # a pool that failed to restore holds less than its snapshots: never saved over them
    trace: TraceWriter | None = None
    records: list[StepRecord] = []
    step = earlier.next_step
    # Steps whose training was handed to the trainers: a save asked for after them holds their
    # updates (an actor runs its calls in order), and the trace holds exactly their rollouts.
    trained_steps = saved_steps = earlier.next_step
    trainers: list[Any] = []
    actors: list[Any] = []
    limit = run.timeout_s
    # The step whose rollouts are in the trace and whose training was handed over, until its record
    # is written: a run stopped in between still records it, with its training's metrics.
    unrecorded: Callable[[list[dict[str, float]], float], StepRecord] | None = None
    restore_sigterm = _stop_on_sigterm()  # after ray.init, whose handler would abort the process
    try:
        use_pool = rollout.draft == "ngramrl"
        if use_pool:
            pool = DrafterPool(config.pool.shards, config.ngramrl, tuple(eos), namespace=config.ray.namespace,
                               snapshot_dir=os.path.join(output_dir, POOL_DIR), name_prefix=f"ngramrl-{os.getpid()}",
                               num_cpus=config.pool.num_cpus_per_shard, sync_wait_ms=config.pool.sync_wait_ms)
            restore_from = os.path.expanduser(config.pool.restore_from or "") or earlier.pool_dir
            if restore_from:
                restored = pool.restore(restore_from)
                logger.info("drafter pool restored from %s: %d prompts", restore_from, restored)
            pool_restored = True
        worker_class = ray.remote(num_cpus=rollout.num_cpus_per_engine, num_gpus=rollout.num_gpus_per_engine,
                                  runtime_env=_threads_env(rollout.threads))(RolloutWorker)
        workers = [worker_class.remote(i, start_dir, rollout, config.ngramrl, pool.settings() if pool else None,
                                       config.model.rollout_dtype, run.seed) for i in range(rollout.engines)]
        actors.extend(workers)
        world = config.trainer.num_actors
        batch = rollout.prompts_per_step * rollout.samples_per_prompt
        trainer_class = ray.remote(num_cpus=config.trainer.num_cpus_per_actor,
                                   num_gpus=config.trainer.num_gpus_per_actor,
                                   runtime_env=_threads_env(config.trainer.threads))(PolicyTrainer)
        trainers = [trainer_class.remote(start_dir, config.model, config.trainer, batch // world, run.seed, rank, world,
                                         rollout.temperature, resume_optimizer=start_dir == earlier.policy_dir)
                    for rank in range(world)]
        actors.extend(trainers)
        master, port = _wait(ray, trainers[0].rendezvous.remote(), "the trainer's rendezvous", min(limit, 300))
        trainer_ready = [t.setup.remote(master, port) for t in trainers]
        # all up (errors surface here); each trainer says why it did not restore the optimizer, if not
        started = _wait(ray, [w.eos_token_ids.remote() for w in workers] + trainer_ready,
                        "starting the rollout engines and trainers", limit)
        if start_dir == earlier.policy_dir:
            not_restored = [why for why in started[len(workers):] if why]
            if not_restored:
                logger.warning("the optimizer's state was not restored (%s): AdamW's moments start afresh",
                               not_restored[0])
        engine_dtype = _engine_dtype(_wait(ray, [w.dtype.remote() for w in workers], "the engines' dtype", limit),
                                     config.model.rollout_dtype)
        trace = TraceWriter(os.path.join(output_dir, TRACE_FILE), TraceHeader(
            vocab_size=vocab_size, eos_token_ids=eos,
            model=os.path.basename(os.path.normpath(model_dir)),
            workload=config.workload.name, temperature=rollout.temperature, top_p=rollout.top_p,
            max_tokens=rollout.max_tokens, extra={"ngramrl_run": os.path.basename(output_dir), "dtype": engine_dtype}),
            continue_at=earlier.trace_whole_bytes, count=earlier.rollout_count, last_epoch=earlier.last_epoch)
        visits: dict[str, int] = dict(earlier.next_epoch)  # a prompt's next epoch
        progress = _progress(run.steps, config.tracking.progress)
        progress.write(f"rollout engines run in {engine_dtype} (model.rollout_dtype: {config.model.rollout_dtype})")
        for step in range(earlier.next_step, earlier.next_step + run.steps):
            chosen = [prompts[(step * rollout.prompts_per_step + i) % len(prompts)]
                      for i in range(rollout.prompts_per_step)]
            epoch = {p.prompt_id: visits.get(p.prompt_id, 0) for p in chosen}
            progress.set_description(f"step {step}: rollouts")
            if before_rollout is not None and pool is not None:
                before_rollout(step, pool)
            begin = time.perf_counter()
            refs = []
            for e, worker in enumerate(workers):
                mine = chosen[e::len(workers)]  # all samples of a prompt on one engine: siblings share drafts
                if mine:
                    refs.append(worker.generate.remote(mine, rollout.samples_per_prompt, epoch,
                                                       run.seed * 1_000_003 + step * 10_007 + e * 1_009))
            results = _wait(ray, refs, f"step {step}'s rollouts", limit)
            rollout_seconds = time.perf_counter() - begin
            step_rollouts: list[Rollout] = [r for res in results for r in res["rollouts"]]
            metrics: dict[str, float] = {}
            for res in results:
                for name, value in res["metrics"].items():
                    metrics[name] = metrics.get(name, 0.0) + value
            for p in chosen:
                visits[p.prompt_id] = visits.get(p.prompt_id, 0) + 1
            progress.set_description(f"step {step}: rewards")
            texts = tokenizer.batch_decode([r.output for r in step_rollouts], skip_special_tokens=True)
            scores = _checked_scores([score_fn(text, references[r.prompt_id]) for text, r in
                                      zip(texts, step_rollouts, strict=True)], step_rollouts, step,
                                     config.workload.reward or config.workload.name)
            advantages = group_advantages(scores, [r.prompt_id for r in step_rollouts])
            progress.set_description(f"step {step}: training")
            samples = [{"prompt": r.prompt, "output": r.output, "advantage": a}
                       for r, a in zip(step_rollouts, advantages, strict=True)]
            share = len(samples) // world
            training = [t.train_step.remote(samples[rank * share:(rank + 1) * share])
                        for rank, t in enumerate(trainers)]
            trained_steps = step + 1
            # The step's rollouts enter the trace once its training is under way (a run stopped
            # before leaves the step to its resumption), and the pool during the training.
            for r, score in zip(step_rollouts, scores, strict=True):
                r.reward, r.policy_version = score, step
                trace.add(r)
            trace.flush()  # before the pool takes them: the pool never holds rollouts the trace lacks
            restarts_before = pool.restarts if pool else 0
            unrecorded = functools.partial(
                _log_step, tracker, output_dir, records, earlier.records, step, scores, metrics, rollout_seconds, pool,
                restarts_before, drafts_ngramrl=config.rollout.draft == "ngramrl",
                prefetches=config.ngramrl.prefetch.budget > 0)
            if pool is not None:
                pool.heal()
                pool.add_rollouts(step_rollouts)
            train_metrics = _wait(ray, training, f"step {step}'s training", limit)
            progress.set_description(f"step {step}: weights")
            sync_begin = time.perf_counter()
            gathered = [t.weights.remote(engine_dtype) for t in trainers]  # every rank joins the gather (ZeRO-3)
            _wait(ray, [w.load_weights.remote(gathered[0]) for w in workers] + gathered[1:],
                  f"step {step}'s weight sync", limit)
            sync_seconds = time.perf_counter() - sync_begin
            sync_error, checksum = _weight_sync_error(ray, trainers, workers, engine_dtype, min(limit, 300))
            if pool is not None and config.pool.save_every and (step + 1) % config.pool.save_every == 0:
                pool.save()
            if run.save_policy_every and (step + 1) % run.save_policy_every == 0:
                saved_steps = _save_policy(ray, trainers, tokenizer, output_dir, trained_steps, limit)
            record = unrecorded(train_metrics, sync_seconds, sync_error, checksum)
            unrecorded = None
            progress.write(record.line())
            progress.update(1)
        progress.close()
        if saved_steps != trained_steps:
            saved_steps = _save_policy(ray, trainers, tokenizer, output_dir, trained_steps, limit)
        result = TrainResult(records, trace.path, output_dir, tracker.directory,
                             policy_path=os.path.join(output_dir, POLICY_DIR))
        _release(ray, actors)  # the report's replay needs no engine or trainer: their GPUs go back now
        result.report_path, summary = write_report(output_dir, earlier.records + [asdict(r) for r in records],
                                                   trace.path, rollout.num_speculative_tokens, config.ngramrl.history)
        tracker.log_report(result.report_path, summary)
        return result
    except (KeyboardInterrupt, Exception) as stopped:
        # Whatever stops the run (Ctrl-C, a reward that fails, an actor lost), what the finished
        # steps made is kept for --resume.
        if unrecorded is not None:  # its rollouts are in the trace and its training went on
            try:
                unrecorded(_wait(ray, training, f"step {step}'s training", min(limit, 300)), 0.0)
            except (KeyboardInterrupt, Exception) as err:  # noqa: BLE001 - the rest is still saved
                logger.warning("step %d's training did not finish (%s): its record is not written", step, err)
        save_policy = None
        if trained_steps != saved_steps:
            save_policy = functools.partial(_save_policy, ray, trainers, tokenizer, output_dir, trained_steps, limit)
        _save_interrupted(output_dir, step, earlier.records, records, trace, pool if pool_restored else None,
                          save_policy, stopped)
        raise
    finally:
        restore_sigterm()
        tracker.finish()
        _release(ray, actors)
        if pool is not None:
            pool.shutdown()
        if started_ray:
            ray.shutdown()


def _write_summary(output_dir: str, before: list[dict[str, Any]], records: list[StepRecord]) -> None:
    """After every step (a run killed outright keeps its steps), whole or not at all (a kill in the
    write would leave a file that refuses --resume)."""
    path = os.path.join(output_dir, SUMMARY_FILE)
    with open(path + ".tmp", "w") as handle:
        json.dump(before + [asdict(r) for r in records], handle, indent=1)
    os.replace(path + ".tmp", path)


def _starting_policy(earlier: EarlierRun, model_dir: str) -> str:
    """The weights a run starts from: those its earlier run saved where it resumes one, else
    ``model.path``'s. A resumed run whose policy lags its trace (the run before stopped without
    saving it, as a crash does; ``run.save_policy_every`` bounds the loss) is said so."""
    if earlier.next_step == 0:
        return model_dir
    if earlier.policy_dir is None:
        logger.warning("the resumed run's %d steps saved no policy (%s/): training restarts from model.path's "
                       "weights", earlier.next_step, POLICY_DIR)
        return model_dir
    if earlier.policy_steps != earlier.next_step:
        logger.warning("the resumed run's policy (%s/) was saved after step %d of its %d: training goes on from it",
                       POLICY_DIR, earlier.policy_steps - 1, earlier.next_step)
    return earlier.policy_dir


def _save_policy(ray: Any, trainers: list[Any], tokenizer: Any, output_dir: str, steps: int, timeout_s: float) -> int:
    """Write the policy trained by ``steps`` steps to ``<output_dir>/policy`` (HF format with the
    tokenizer: ``model.path`` can name it), replacing the one there only once it is complete.
    Every trainer rank joins (a collective under ZeRO-3); rank 0 writes. Returns ``steps``."""
    final = os.path.join(output_dir, POLICY_DIR)
    staging, replaced = final + ".saving", final + ".replaced"
    for path in (staging, replaced):
        shutil.rmtree(path, ignore_errors=True)
    _wait(ray, [t.save_policy.remote(staging) for t in trainers], "saving the policy", timeout_s)
    tokenizer.save_pretrained(staging)
    with open(os.path.join(staging, POLICY_FILE), "w") as handle:
        json.dump({"steps": steps}, handle)
    if os.path.exists(final):
        os.replace(final, replaced)
    os.replace(staging, final)
    shutil.rmtree(replaced, ignore_errors=True)
    return steps


def _checked_scores(scores: list[Any], rollouts: list[Rollout], step: int, reward_name: str) -> list[float]:
    """The step's rewards as floats; a reward that is not a finite number stops the run before it
    trains on it (one NaN makes every advantage of its group NaN, and then the weights)."""
    checked = []
    for score, rollout in zip(scores, rollouts, strict=True):
        try:
            value = float(score)
        except (TypeError, ValueError):
            value = math.nan
        if isinstance(score, (str, bytes)) or not math.isfinite(value):
            raise ValueError(f"the reward {reward_name!r} returned {score!r} for a rollout of prompt "
                             f"{rollout.prompt_id!r} in step {step}: a reward must be a finite number")
        checked.append(value)
    return checked


def _release(ray: Any, actors: list[Any]) -> None:
    """Kill the run's engines and trainers (and forget them: a second call does nothing)."""
    while actors:
        try:
            ray.kill(actors.pop())
        except Exception:  # noqa: BLE001 - an actor already gone
            pass


def _save_interrupted(output_dir: str, step: int, before: list[dict[str, Any]], records: list[StepRecord],
                      trace: TraceWriter | None, pool: DrafterPool | None,
                      save_policy: Callable[[], int] | None, stopped: BaseException) -> None:
    """SIGINT, SIGTERM (``Terminated``) or an error that stops the run: keep what the finished
    steps made, and say what was kept."""
    import sys

    how = ("terminated (SIGTERM)" if isinstance(stopped, Terminated) else "interrupted"
           if isinstance(stopped, KeyboardInterrupt) else f"stopped by an error ({type(stopped).__name__}: {stopped})")
    saved = [f"{METRICS_FILE} and {SUMMARY_FILE} ({len(records)} steps this run)"]
    _write_summary(output_dir, before, records)
    if trace is not None:
        trace.flush()
        saved.append(f"{TRACE_FILE} ({trace.count} rollouts)")
    if pool is not None:
        failed = [str(index) for index, path in enumerate(pool.save(timeout_s=30)) if path is None]
        saved.append(f"{POOL_DIR}/ (the drafter pool" + (f"; shards {', '.join(failed)} could not save now"
                                                         if failed else "") + ")")
    if save_policy is not None:  # last: the trainers may still be finishing a step's update
        print(f"ngramrl train: {how}; saved {', '.join(saved)}; saving the policy (Ctrl-C to stop without it)",
              file=sys.stderr, flush=True)
        try:
            saved.append(f"{POLICY_DIR}/ (the policy after {save_policy()} steps)")
        except Exception as err:  # noqa: BLE001 - what else was saved is still said
            saved.append(f"not the policy ({err})")
    print(f"ngramrl train: {how} in step {step}; saved {', '.join(saved)} in {output_dir}; continue it "
          f"with --resume", file=sys.stderr, flush=True)


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a scheduler's time limit, ``docker stop``): stopped as by Ctrl-C, what the
    finished steps made saved (``ngramrl train`` exits 143)."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated()


def _stop_on_sigterm() -> Callable[[], Any]:
    """From now on SIGTERM raises ``Terminated`` in the main thread (where Python can handle it);
    returns what puts the handler before it back (the default, where that was not Python's: Ray's
    would abort the process)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    return functools.partial(signal.signal, signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _log_step(tracker: Tracker, output_dir: str, records: list[StepRecord], before: list[dict[str, Any]], step: int,
              scores: list[float], engine: dict[str, float], rollout_seconds: float, pool: DrafterPool | None,
              restarts_before: int, train_metrics: list[dict[str, float]], sync_seconds: float,
              sync_error: float = 0.0, checksum: float = 0.0, *, drafts_ngramrl: bool,
              prefetches: bool) -> StepRecord:
    """A step's record, once its training is done: kept, logged and in the summary."""
    health = pool.health() if pool is not None else []
    record = _record(step, scores, train_metrics, engine, rollout_seconds, sync_seconds,
                     restarts=(pool.restarts if pool else 0), healthy=sum(h is not None for h in health),
                     drafts_ngramrl=drafts_ngramrl, prefetches=prefetches)
    record.weight_sync_error, record.policy_checksum = sync_error, checksum
    records.append(record)
    tracker.log(step, {**{k: v for k, v in asdict(record).items() if v is not None},
                       **{f"engine/{k}": v for k, v in engine.items()},
                       "pool/restarts_this_step": (pool.restarts if pool else 0) - restarts_before})
    _write_summary(output_dir, before, records)
    return record


def _record(step: int, scores: list[float], train_metrics: list[dict[str, float]], engine: dict[str, float],
            rollout_seconds: float, sync_seconds: float, restarts: int, healthy: int, drafts_ngramrl: bool,
            prefetches: bool) -> StepRecord:
    import statistics

    tokens = engine.get("tokens", 0.0)
    accepted = engine.get("vllm_num_accepted_tokens", 0.0)
    rates = draft_rates(engine)
    mean = lambda key: sum(m[key] for m in train_metrics) / len(train_metrics)  # noqa: E731
    return StepRecord(
        step=step, reward=statistics.fmean(scores), reward_std=statistics.pstdev(scores), loss=mean("loss"),
        kl=mean("kl"), clip_fraction=mean("clip_fraction"), rollout_seconds=rollout_seconds,
        train_seconds=max(m["train_seconds"] for m in train_metrics), sync_seconds=sync_seconds, tokens=int(tokens),
        tokens_per_forward=ratio(tokens, tokens - accepted),
        offered_tokens_per_forward=rates["offered_tokens_per_forward"] if drafts_ngramrl else None,
        acceptance=ratio(accepted, engine.get("vllm_num_draft_tokens", 0.0)),
        coverage=rates["prefetch_coverage"] if drafts_ngramrl and prefetches else None,
        drafter_ms_per_step=rates["drafter_ms_per_step"] if drafts_ngramrl else None,
        pool_unsynced_prompts=int(rates["pool_unsynced_prompts"]),
        pool_restarts=restarts, pool_healthy=healthy,
        trained_samples=int(sum(m.get("trained_samples", 0.0) for m in train_metrics)))


CHECKED_WEIGHTS = ["model.embed_tokens.weight"]


def _engine_dtype(dtypes: list[str], requested: str) -> str:
    """The one dtype the trainers send weights in: every engine's ``rollout_dtype`` as resolved on
    its own device. Engines that resolved ``auto`` differently (nodes of different hardware) would
    each need their own copy of the weights: refused, with what to set."""
    if len(set(dtypes)) > 1:
        raise ValueError(f"model.rollout_dtype={requested!r} resolved to {', '.join(dtypes)} on engines "
                         f"0-{len(dtypes) - 1} (their devices differ): set model.rollout_dtype to one of them")
    return dtypes[0]


def _weight_sync_error(ray: Any, trainers: list[Any], workers: list[Any], dtype: str,
                       timeout_s: float) -> tuple[float, float]:
    """How far the engines' and the other ranks' weights are from rank 0's, on a parameter all
    name the same; and rank 0's own sum of it. Every rank is asked (a collective under ZeRO-3)."""
    expected, *others = _wait(ray, [t.param_sums.remote(CHECKED_WEIGHTS, dtype) for t in trainers],
                              "the trainers' weight check", timeout_s)
    worst = 0.0
    for sums in others + _wait(ray, [w.param_sums.remote(CHECKED_WEIGHTS) for w in workers],
                               "the engines' weight check", timeout_s):
        for name, value in expected.items():
            if name not in sums:
                continue
            worst = max(worst, abs(sums[name] - value) / max(1.0, abs(value)))
    return worst, sum(expected.values())


class _NoProgress:
    def set_description(self, text: str) -> None:
        pass

    def write(self, text: str) -> None:
        print(text, flush=True)

    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoProgress()
    from tqdm import tqdm

    return tqdm(total=total, unit="step", dynamic_ncols=True)
