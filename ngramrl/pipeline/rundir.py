"""A run's output directory: checked before anything starts, never emptied by accident.

    plan = plan_run_dir(config)      # checks only (``ngramrl train --check`` stops here)
    earlier = plan.prepare()         # overwrite: delete the earlier run's files; resume: read them

A directory holding an earlier run's files is refused unless ``run.if_exists`` says ``resume``
(the new steps append to its metrics and trace, each prompt's epochs continue after its last
one, and the drafter pool starts from its snapshots) or ``overwrite`` (the earlier run's files,
and only those, are deleted first).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Any

from ngramrl.core.trace import Rollout, TraceHeader, iter_trace, whole_length
from ngramrl.paths import OutputPaths, inside
from ngramrl.pipeline.config import ConfigError, TrainConfig
from ngramrl.pipeline.pool import check_snapshots

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
TRACE_FILE = "rollouts.jsonl.gz"
POOL_DIR = "pool"
WANDB_DIR = "wandb"
REPORT_PNG = "report.png"
REPORT_JSON = "report.json"
POLICY_DIR = "policy"  # the trained policy (HF format), with POLICY_FILE: how many steps trained it
POLICY_FILE = "ngramrl_policy.json"
RUN_FILES = (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, TRACE_FILE, POOL_DIR, WANDB_DIR, REPORT_PNG, REPORT_JSON,
             POLICY_DIR)
DIRECTORIES = (POOL_DIR, WANDB_DIR, POLICY_DIR)
RESUMED_CONFIG = "config-resume-{}.json"
# What a resumed run must do as the run before it: its rollouts join that run's trace and drafter
# history under the same prompt ids, and its trace's header says how they were all sampled.
KEPT_ON_RESUME = ("workload.name", "workload.task", "workload.task_settings", "workload.seed", "rollout.temperature",
                  "rollout.top_p", "rollout.max_tokens")


@dataclass
class EarlierRun:
    """What a resumed run takes over from the run before it."""

    next_step: int = 0                                           # the first step number of this run
    next_epoch: dict[str, int] = field(default_factory=dict)    # per prompt: its next epoch
    rollout_count: int = 0                                       # rollouts in its trace
    trace_whole_bytes: int | None = None                         # its trace's whole part (None: no trace)
    records: list[dict[str, Any]] = field(default_factory=list)  # summary.json so far
    pool_dir: str | None = None                                  # its drafter pool snapshots
    resumes: int = 0                                             # earlier resumptions of it
    policy_dir: str | None = None                                # the policy it saved
    policy_steps: int = 0                                        # the steps that trained that policy
    header: TraceHeader | None = None                            # its trace's header
    prompt_hashes: dict[str, int] = field(default_factory=dict)  # per prompt id: hash of its prompt tokens
    config: dict[str, Any] | None = None                         # its last configuration (config*.json)
    config_file: str | None = None                               # where that was read

    @property
    def last_epoch(self) -> int:
        """The last epoch its trace holds (-1: none)."""
        return max(self.next_epoch.values(), default=0) - 1


@dataclass
class RunDirPlan:
    path: str                 # absolute output directory
    mode: str                 # "new", "resume" or "overwrite"
    found: list[str]          # the earlier run's files in it
    earlier: EarlierRun = field(default_factory=EarlierRun)  # what a resumed run takes over, read while planning

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def prepare(self) -> EarlierRun:
        """Make the directory ready: create it, delete an overwritten run's files, or hand over what
        a resumed one left (read and validated by ``plan_run_dir``)."""
        os.makedirs(self.path, exist_ok=True)
        if self.mode == "overwrite":
            for name in self.found:
                target = self.file(name)
                shutil.rmtree(target) if os.path.isdir(target) else os.remove(target)
            for stale in glob.glob(self.file(TRACE_FILE + ".tmp-*")):
                os.remove(stale)
            for stale in glob.glob(self.file(POLICY_DIR + ".*")):  # a save cut short
                shutil.rmtree(stale, ignore_errors=True)
            return EarlierRun()
        return self.earlier

    def config_file(self) -> str:
        """Where this run's configuration goes: config.json, or config-resume-N.json when resuming
        (the earlier run's configuration is kept)."""
        if self.mode != "resume" or not os.path.exists(self.file(CONFIG_FILE)):
            return self.file(CONFIG_FILE)
        n = 1
        while os.path.exists(self.file(RESUMED_CONFIG.format(n))):
            n += 1
        return self.file(RESUMED_CONFIG.format(n))


def read_earlier_run(path: str) -> EarlierRun:
    earlier = EarlierRun()
    trace_path = os.path.join(path, TRACE_FILE)
    if os.path.exists(trace_path):
        # read as it streams (a long run's trace is gigabytes), and only its whole part: a run
        # stopped in an append leaves a torn tail, which the resumed run's writer cuts off
        earlier.trace_whole_bytes = whole_length(trace_path)
        for rollout in iter_trace(trace_path, earlier.trace_whole_bytes):
            if not isinstance(rollout, Rollout):
                earlier.header = rollout
                continue
            earlier.rollout_count += 1
            if rollout.prompt_id not in earlier.prompt_hashes:  # (the reader checks the rest repeat it)
                earlier.prompt_hashes[rollout.prompt_id] = hash(tuple(rollout.prompt))
            earlier.next_epoch[rollout.prompt_id] = max(earlier.next_epoch.get(rollout.prompt_id, 0),
                                                        rollout.epoch + 1)
            if rollout.policy_version is not None:
                earlier.next_step = max(earlier.next_step, rollout.policy_version + 1)
    summary_path = os.path.join(path, SUMMARY_FILE)
    if os.path.exists(summary_path):
        earlier.records = _read_json(summary_path)
        if not isinstance(earlier.records, list):
            raise ConfigError(f"{summary_path}: not a run summary (a list of step records)")
    metrics_path = os.path.join(path, METRICS_FILE)
    if os.path.exists(metrics_path):
        with open(metrics_path, encoding="utf-8") as handle:
            for line_no, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    step = json.loads(line)["step"]
                except (ValueError, KeyError, TypeError):
                    if not line.endswith("\n"):  # the last line, torn by a run stopped writing it: cut at resume
                        continue
                    raise ConfigError(f"{metrics_path}:{line_no}: not a metrics record (JSON with a step)") from None
                earlier.next_step = max(earlier.next_step, int(step) + 1)
    if glob.glob(os.path.join(path, POOL_DIR, "shard-*.json.gz")):
        earlier.pool_dir = os.path.join(path, POOL_DIR)
    earlier.resumes = len(glob.glob(os.path.join(path, RESUMED_CONFIG.format("*"))))
    for name in [RESUMED_CONFIG.format(n) for n in range(earlier.resumes, 0, -1)] + [CONFIG_FILE]:
        config_path = os.path.join(path, name)
        if os.path.exists(config_path):
            earlier.config, earlier.config_file = _read_json(config_path), config_path
            break
    policy_file = os.path.join(path, POLICY_DIR, POLICY_FILE)
    if os.path.exists(policy_file):
        try:
            with open(policy_file, encoding="utf-8") as handle:
                earlier.policy_steps = int(json.load(handle)["steps"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ConfigError(f"{policy_file}: cannot be read to resume the run ({err}); it says how many "
                              f"steps trained the policy saved beside it") from None
        earlier.policy_dir = os.path.join(path, POLICY_DIR)
    return earlier


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path}: cannot be read to resume the run ({err})") from None


def check_same_settings(earlier: EarlierRun, config: TrainConfig, output_dir: str) -> None:
    """A resumed run samples as the run before it, the same prompts (``KEPT_ON_RESUME``), or it
    is refused before anything starts: its rollouts would join that run's trace and history
    under the same prompt ids, and the trace's header would say how neither was sampled."""
    if earlier.config is None:
        return
    now = config.to_dict()
    for key in KEPT_ON_RESUME:
        section, name = key.split(".")
        recorded = earlier.config.get(section)
        if not isinstance(recorded, dict) or name not in recorded:  # a configuration that does not say
            continue
        before, after = recorded[name], now[section][name]
        if before != after:
            raise ConfigError(f"run.output_dir {output_dir!r} holds a run made with {key} = {before!r} "
                              f"({earlier.config_file}); this run's {key} is {after!r}. A resumed run continues "
                              f"that run's trace and prompts: resume it with the same {key}, or start a new run "
                              f"(another run.output_dir, or --overwrite)")


def check_same_prompts(earlier: EarlierRun, prompts: dict[str, list[int]], vocab_size: int, eos: list[int],
                       output_dir: str) -> None:
    """A resumed run's prompts, as its model's tokenizer makes them, are the earlier run's under
    the same ids, and its vocabulary and end-of-sequence ids those of its trace; else refused
    before anything starts (a trace that gives one prompt id two prompts is unreadable)."""
    trace = os.path.join(output_dir, TRACE_FILE)
    header = earlier.header
    if header is not None and (header.vocab_size, list(header.eos_token_ids)) != (vocab_size, list(eos)):
        raise ConfigError(f"{trace} was sampled with a vocabulary of {header.vocab_size} tokens and end-of-sequence "
                          f"ids {list(header.eos_token_ids)}; this run's model (model.path, or the policy/ it "
                          f"resumes from) has {vocab_size} and {list(eos)}: resume with that run's model, or start "
                          f"a new run (another run.output_dir, or --overwrite)")
    for prompt_id, tokens in prompts.items():
        known = earlier.prompt_hashes.get(prompt_id)
        if known is not None and known != hash(tuple(tokens)):
            raise ConfigError(f"prompt {prompt_id!r} is not the prompt of that id in {trace} (other tokens): the "
                              f"workload, its settings, or the model's tokenizer or chat template differ from the "
                              f"earlier run's. Resume with that run's settings, or start a new run (another "
                              f"run.output_dir, or --overwrite)")


def plan_run_dir(config: TrainConfig) -> RunDirPlan:
    """Check the output directory and every path the run writes, changing nothing."""
    run = config.run
    outputs = OutputPaths(inputs=[p for p in (config.model.path, config.pool.restore_from)
                                  if p and os.path.exists(os.path.expanduser(p))])
    path = outputs.directory(run.output_dir, "run.output_dir")
    for name in RUN_FILES:
        target = os.path.join(path, name)
        wants_dir = name in DIRECTORIES
        if os.path.exists(target) and os.path.isdir(target) != wants_dir:
            kind = "a file" if wants_dir else "a directory"
            raise ConfigError(f"run.output_dir {run.output_dir!r}: {target} is {kind}; the run writes "
                              f"{'a directory' if wants_dir else 'a file'} there")
    found = [name for name in RUN_FILES if os.path.exists(os.path.join(path, name))]
    found += sorted(os.path.basename(f) for f in glob.glob(os.path.join(path, RESUMED_CONFIG.format("*"))))
    mode = "new"
    if found:
        if run.if_exists == "refuse":
            raise ConfigError(
                f"run.output_dir {run.output_dir!r} holds an earlier run ({', '.join(found)}); continue it with "
                f"--resume (run.if_exists=resume), replace it with --overwrite (run.if_exists=overwrite), or "
                f"choose another run.output_dir")
        mode = run.if_exists
    if mode == "overwrite":  # the model must not be among what --overwrite deletes (an earlier run's policy/)
        model = os.path.expanduser(config.model.path)
        doomed = next((name for name in found if inside(model, os.path.join(path, name))), None)
        if doomed is not None:
            raise ConfigError(f"model.path {config.model.path!r} lies in {doomed} of run.output_dir "
                              f"{run.output_dir!r}, whose earlier run --overwrite deletes; copy the model "
                              f"elsewhere first, or --resume that run")
    restore = config.pool.restore_from
    if restore and mode == "overwrite" and inside(os.path.expanduser(restore), path):
        raise ConfigError(f"pool.restore_from {restore!r} lies in run.output_dir {run.output_dir!r}, whose "
                          f"earlier run --overwrite deletes; copy the snapshots elsewhere first")
    if config.rollout.draft == "ngramrl":  # the snapshots it will restore: checked now, not after Ray starts
        snapshots = os.path.expanduser(restore) if restore else os.path.join(path, POOL_DIR)
        if restore or (mode == "resume" and glob.glob(os.path.join(snapshots, "shard-*.json.gz"))):
            check_snapshots(snapshots, config.pool.shards)
    # A resumed run's files are read now (a corrupted trace is reported with its file and line),
    # so `train --check` finds what the run would.
    earlier = read_earlier_run(path) if mode == "resume" else EarlierRun()
    check_same_settings(earlier, config, run.output_dir)
    return RunDirPlan(path, mode, found, earlier)
