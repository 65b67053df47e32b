"""The engine-step harness: verification, continuous batching, the simulated clock the proposer
learns from, the native core's background window, and the copies that fill a phase."""

import time
from dataclasses import dataclass, field

import pytest

from ngramrl.bench.steps import (
    PhaseRequest,
    SimulatedEngine,
    StepRecord,
    VirtualClock,
    build_engine,
    copies_for,
    prepare_workload,
    summarize_steps,
)
from ngramrl.core.profile import HostOverhead
from ngramrl.core.trace import Rollout, Trace, TraceHeader


@dataclass
class LinearTimes:
    """A forward of base + per_token * tokens seconds, no host work."""

    base: float = 0.01
    per_request: float = 0.0
    per_token: float = 0.0
    host: HostOverhead = field(default_factory=lambda: HostOverhead(0.0, 0.0))

    def forward_seconds(self, requests, tokens, context, prefill_tokens=0):
        return self.base + self.per_request * requests + self.per_token * (tokens - requests)


class Oracle:
    """Drafts the true next tokens (up to k) of each request: what a perfect drafter proposes."""

    def __init__(self, truth, k):
        self.truth, self.k, self.runner, self.calls = truth, k, None, []

    def bind_runner(self, runner):
        self.runner = runner

    def propose(self, sampled, lengths, token_ids_cpu):
        self.calls.append([len(s) for s in sampled])
        drafts = []
        for row, req_id in enumerate(self.runner.input_batch.req_ids):
            done = len(self.runner.requests[req_id].output_token_ids)
            assert done == lengths[row] - len(self.runner.requests[req_id].prompt_token_ids)
            drafts.append(self.truth[req_id][done:done + self.k])
        return drafts


def requests(lengths):
    return [PhaseRequest(f"r{i}", f"p{i}", 1, [1, 2, 3], list(range(10, 10 + n))) for i, n in enumerate(lengths)]


def test_without_drafts_each_step_commits_one_token_per_request_and_slots_are_refilled():
    engine = SimulatedEngine(None, VirtualClock(), LinearTimes(), synchronous=False, flush_bytes=0)
    records = engine.run_phase(requests([5, 3, 4]), batch=2)
    # r0 and r1 start; r1 ends after 3 steps, r2 takes its slot: 5 steps for r0, 3 + 4 for r1 then r2
    assert [r.rows for r in records] == [2, 2, 2, 2, 2, 1, 1]
    assert sum(r.committed for r in records) == 12
    assert records[0].decode_rows == 0 and records[3].decode_rows == 1  # prefills: r0 and r1, then r2


def test_a_phase_runs_with_the_heap_that_existed_before_it_frozen_as_in_a_warm_vllm_worker():
    import gc

    class Watcher(Oracle):
        def propose(self, sampled, lengths, token_ids_cpu):
            self.frozen.append(gc.get_freeze_count())
            return super().propose(sampled, lengths, token_ids_cpu)

    reqs = requests([4, 2])
    watcher = Watcher({r.req_id: r.output for r in reqs}, k=2)
    watcher.frozen = []
    before = gc.get_freeze_count()
    SimulatedEngine(watcher, VirtualClock(), LinearTimes(), synchronous=True, flush_bytes=0).run_phase(reqs, batch=2)
    assert watcher.frozen and min(watcher.frozen) > before
    assert gc.get_freeze_count() == before


def test_waves_drain_before_the_next_starts():
    engine = SimulatedEngine(None, VirtualClock(), LinearTimes(), synchronous=False, flush_bytes=0)
    records = engine.run_phase(requests([5, 3, 4]), batch=2, waves=True)
    assert [r.rows for r in records] == [2, 2, 2, 1, 1, 1, 1, 1, 1]


def test_a_perfect_drafter_commits_its_draft_plus_one_token_per_step():
    reqs = requests([9, 4])
    oracle = Oracle({r.req_id: r.output for r in reqs}, k=3)
    engine = SimulatedEngine(oracle, VirtualClock(), LinearTimes(), synchronous=True, flush_bytes=0)
    records = engine.run_phase(reqs, batch=2)
    # first step: the prefill samples one token; then 3 accepted + 1 per step
    assert oracle.calls == [[1, 1], [4, 3], [4]]
    assert [r.draft_tokens for r in records] == [0, 6, 3]
    assert [r.committed for r in records] == [2, 7, 4]


def test_step_time_is_synchronous_sum_or_asynchronous_overlap():
    record = StepRecord(rows=4, decode_rows=4, draft_tokens=0, committed=4, forward_s=0.01, host_s=0.004,
                        critical_ns=1_000_000, offpath_ns=0)
    assert record.seconds(synchronous=True) == pytest.approx(0.015)
    assert record.seconds(synchronous=False) == pytest.approx(0.011)


def test_virtual_clock_moves_only_while_running_or_advanced():
    clock = VirtualClock()
    start = clock()
    assert clock() == start
    clock.advance(0.5)
    assert clock() == start + 500_000_000
    with clock.running():
        sum(range(10000))
    assert clock() > start + 500_000_000
    frozen = clock()
    assert clock() == frozen


def toy_trace(epochs=3, prompts=2, samples=2, length=40):
    rollouts = []
    for epoch in range(epochs):
        for p in range(prompts):
            base = [10 + (7 * i + 3 * p) % 23 for i in range(length)]
            for s in range(samples):
                output = base[:length - s] + [2]
                rollouts.append(Rollout(f"p{p}", epoch, s, [1, 3, 4 + p], output, "stop"))
    return Trace(TraceHeader(vocab_size=64, eos_token_ids=[2], workload="toy"), rollouts, "toy.jsonl")


def test_copies_of_prompts_never_share_tokens_but_end_of_sequence():
    trace = toy_trace()
    workload = prepare_workload(trace, first_epoch=2, copies=3)
    assert len(workload.phases) == 1 and len(workload.phases[0]) == 3 * 4
    assert {r.epoch for r in workload.history} == {0, 1} and len(workload.history) == 3 * 8
    by_copy = {}
    for request in workload.phases[0]:
        by_copy.setdefault(request.prompt_id.partition("~")[2] or "0", set()).update(request.output)
    tokens = list(by_copy.values())
    assert len(tokens) == 3
    for i in range(3):
        for j in range(i + 1, 3):
            assert tokens[i] & tokens[j] == {2}
    original = [r for r in workload.phases[0] if "~" not in r.prompt_id]
    copy = [r for r in workload.phases[0] if r.prompt_id.endswith("~1")]
    assert [len(r.output) for r in original] == [len(r.output) for r in copy]
    assert copies_for(trace, 2, 9) == 3


def test_the_proposers_cost_model_learns_the_simulated_step_times():
    # Draft tokens cost 1 ms each on top of a 20 ms forward: the proposer's fit sees exactly that,
    # through the simulated clock (a real clock would see this loop's microseconds instead).
    trace = toy_trace(epochs=3, prompts=2, samples=4, length=120)
    workload = prepare_workload(trace, first_epoch=2)
    times = LinearTimes(base=0.02, per_token=0.001)
    engine = build_engine("ngramrl", workload, k=4, times=times, flush_bytes=0)
    engine.run_phase(workload.phases[0], batch=4)
    engine.close()
    base, per_request, per_token, per_verify = engine.proposer.cost.coefficients
    assert engine.proposer.cost.steps > 20
    assert base + 4 * per_request == pytest.approx(0.02, rel=0.02)
    assert per_token == pytest.approx(0.001, rel=0.05)


def test_a_prefetching_native_core_works_during_the_forward_and_the_drafts_stay_the_same():
    from ngramrl.core.extension import native_module

    if native_module() is None:
        pytest.skip("the native core is not built: the reference core has no background work")
    trace = toy_trace(epochs=3, prompts=2, samples=4, length=80)
    workload = prepare_workload(trace, first_epoch=2)
    times = LinearTimes(base=0.02)  # verifying is free: drafts are kept whole; 20 ms of real time per forward
    results, hits = {}, {}
    for method in ("ngramrl", "ngramrl-prefetch"):
        engine = build_engine(method, workload, k=4, times=times, flush_bytes=0)
        engine.proposer.offload = None  # every step hands its work to the background (prefetch "on")
        records = engine.run_phase(workload.phases[0], batch=4)
        engine.close()
        results[method] = records
        hits[method] = engine.proposer.stats.prefetch_hits / engine.proposer.stats.row_steps
    assert sum(r.offpath_ns for r in results["ngramrl"]) == 0
    assert sum(r.offpath_ns for r in results["ngramrl-prefetch"]) > 0
    assert hits["ngramrl"] == 0 and hits["ngramrl-prefetch"] > 0.5  # the forward's time was the worker's
    # a prefetched draft is the draft the synchronous lookup would make (or an older one, after a
    # rollout finished): about as many steps for the same tokens
    steps = [len(results[m]) for m in ("ngramrl", "ngramrl-prefetch")]
    assert abs(steps[0] - steps[1]) <= 0.05 * steps[0]


@pytest.mark.parametrize("max_budget", [2, 8])
def test_the_prefetchs_budget_grows_to_its_most_where_the_forward_leaves_the_background_idle(max_budget):
    from ngramrl.config import NgramRLConfig, PrefetchConfig
    from ngramrl.core.extension import native_module

    if native_module() is None:
        pytest.skip("the native core is not built: the reference core prefetches in the call, with no forward beside")
    trace = toy_trace(epochs=3, prompts=2, samples=4, length=80)
    workload = prepare_workload(trace, first_epoch=2)
    config = NgramRLConfig(prefetch=PrefetchConfig(budget=2, max_budget=max_budget))
    engine = build_engine("ngramrl-prefetch", workload, k=4, times=LinearTimes(base=0.02), flush_bytes=0,
                          config=config)
    engine.proposer.offload = None  # every step hands its work to the background (prefetch "on")
    engine.run_phase(workload.phases[0], batch=4)
    engine.close()
    stats = engine.proposer.source.stats()
    # a few rows' prefetch takes microseconds of a 20 ms forward: it doubles each step up to its most
    assert stats["prefetch_budget"] == max_budget
    assert 2 <= stats["prefetch_budget_mean"] <= max_budget and (stats["prefetch_budget_mean"] > 2) == (max_budget > 2)
    assert engine.proposer.core.prefetch_config.budget == max_budget


@pytest.mark.parametrize("wait_out", [True, False])
def test_the_proposer_is_called_a_forwards_length_after_its_last_call_unless_told_not_to_wait(wait_out):
    truth = {f"r{i}": list(range(10, 10 + n)) for i, n in enumerate([12, 9, 14])}
    oracle = Oracle(truth, k=0)  # no drafts: one token per forward, a step per token
    called = []
    propose = oracle.propose

    def timed(*args):
        called.append(time.perf_counter())
        return propose(*args)

    oracle.propose = timed
    engine = SimulatedEngine(oracle, VirtualClock(), LinearTimes(base=0.01), synchronous=False, flush_bytes=0,
                             wait_out=wait_out)
    engine.run_phase(requests([12, 9, 14]), batch=3)
    gaps = sorted(b - a for a, b in zip(called, called[1:], strict=False))
    if wait_out:
        assert gaps[0] >= 0.01  # every forward's 10 ms passed before the next call
    else:
        assert gaps[len(gaps) // 2] < 0.002


def test_step_statistics_count_the_steps_with_the_batch_full():
    def record(rows, critical_us):
        return StepRecord(rows, rows, 0, rows, 0.01, 0.0, critical_us * 1000, 0)

    summary = summarize_steps([record(4, 100), record(4, 300), record(2, 5000)], batch=4)
    assert summary.steps == 2 and summary.step_us_median == pytest.approx(200)
    assert summary.request_us_mean == pytest.approx(50)
    assert summary.tokens_per_forward == pytest.approx(1.0)


def test_copies_take_ids_no_prompt_of_the_trace_has_and_stay_32_bit_however_large_the_vocabulary():
    """A trace whose prompt ids already look like copies ("p0~1") keeps them apart from the copies
    it gets, and a vocabulary of 1.5 billion ids still gives copies 32-bit token ids (the
    trace's distinct ids renumbered above it), each copy a renumbering of the original."""
    trace = toy_trace()
    for rollout in trace.rollouts:
        if rollout.prompt_id == "p1":
            rollout.prompt_id = "p0~1"
    trace.header.vocab_size = 1_500_000_000
    workload = prepare_workload(trace, first_epoch=2, copies=3)
    by_id: dict[str, list[PhaseRequest]] = {}
    for request in workload.phases[0]:
        by_id.setdefault(request.prompt_id, []).append(request)
    assert len(by_id) == 2 * 3 and all(len(requests) == 2 for requests in by_id.values())
    assert len({r.req_id for r in workload.phases[0]}) == 3 * 4
    tokens = [t for r in workload.phases[0] + workload.history for t in (*r.prompt, *r.output)]
    assert 1_500_000_000 <= max(tokens) < 2**31
    originals = {(r.prompt_id, r.req_id.rsplit("/", 1)[1]): r for r in workload.phases[0]
                 if r.prompt_id in ("p0", "p0~1")}
    copies = [r for r in workload.phases[0] if r.prompt_id not in ("p0", "p0~1")]
    assert len(copies) == 2 * 4
    for copy in copies:
        of = max((prompt_id for prompt_id in ("p0", "p0~1") if copy.prompt_id.startswith(prompt_id + "~")), key=len)
        source = originals[(of, copy.req_id.rsplit("/", 1)[1])]
        renumbering = dict(zip(source.output, copy.output, strict=True))
        assert len(renumbering) == len(set(renumbering.values())) == len(set(source.output))
        assert renumbering[2] == 2 and all(new >= 1_500_000_000 for old, new in renumbering.items() if old != 2)


def test_copies_that_would_pass_32_bit_token_ids_are_refused():
    trace = toy_trace()
    trace.header.vocab_size = 2**31 - 10
    with pytest.raises(ValueError, match="32-bit token ids"):
        prepare_workload(trace, first_epoch=2, copies=3)


def test_a_rollout_without_output_makes_no_request():
    trace = toy_trace()
    trace.rollouts[-1].output = []
    workload = prepare_workload(trace, first_epoch=2, copies=2)
    assert len(workload.phases[0]) == 2 * 3 and all(r.output for r in workload.phases[0])
    assert copies_for(trace, 2, 6) == 2  # three rollouts of epoch 2 can be replayed
