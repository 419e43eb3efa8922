"""The batching scheduler alone: no model, no tensors, made-up tokens. It decides who runs where and when;
test_batching.py checks the same schedules with the model in the loop, test_paged_batching.py the paged ones."""

from __future__ import annotations

import pytest

from llmstep.engines.decoding import budget
from llmstep.engines.kv_manager import KVCacheManager
from llmstep.engines.scheduler import Completion, Job, Scheduler

MAX_LEN = 48


def job(i: int, max_new_tokens: int, prompt_len: int = 3, arrival: int = 0, stops=()) -> Job:
    return Job(Completion(id=i, prompt_ids=[1] * prompt_len, arrival=arrival),
               budget(prompt_len, max_new_tokens, MAX_LEN), set(stops))


def drive(jobs: list[Job], n_slots: int, policy: str, token=lambda job: 7):
    """Run the scheduler as ContinuousBatcher.run does (a contiguous cache: one block of MAX_LEN per slot), with
    token(job) in place of the model's forward."""
    ticks = iter(range(10**6))
    s = Scheduler(jobs, n_slots, KVCacheManager(n_slots, MAX_LEN), policy=policy, clock=lambda: float(next(ticks)))
    while not s.done:
        s.begin_step()
        work = s.schedule()
        assert all(c.n_tokens == 1 or c.start == 0 for c in (w.chunk for w in work))  # whole prompts, or decodes
        s.update(work, [token(w.job) for w in work])
        s.end_step()
    return s.run


def test_continuous_schedule_by_hand():
    """Two slots, four requests of 2, 5, 3 and 1 new tokens arriving together (as test_batching's, model-free):
    every running request gets one token a step, a newcomer's from its prompt; a finished one frees its slot for
    the next step."""
    run = drive([job(i, n) for i, n in enumerate((2, 5, 3, 1))], 2, "continuous")
    assert [c.admitted for c in run.completions] == [0, 0, 2, 5]
    assert [c.finished for c in run.completions] == [1, 4, 4, 5]
    assert [c.slot for c in run.completions] == [0, 1, 0, 0]
    assert run.timeline == [[0, 1], [0, 1], [2, 1], [2, 1], [2, 1], [3, -1]]
    assert run.prefills == [(0, 0, 0), (0, 1, 1), (2, 0, 2), (5, 0, 3)]
    assert [len(c.tokens) for c in run.completions] == [2, 5, 3, 1]
    assert all(c.stop_reason == "length" for c in run.completions)
    assert run.kv_stats["prefill_tokens"] == 4 * 3 and run.kv_stats["decode_tokens"] == 1 + 4 + 2 + 0


def test_static_schedule_by_hand():
    run = drive([job(i, n) for i, n in enumerate((2, 5, 3, 1))], 2, "static")
    assert [c.admitted for c in run.completions] == [0, 0, 5, 5]
    assert [c.finished for c in run.completions] == [1, 4, 7, 5]
    assert run.timeline == [[0, 1], [0, 1], [-1, 1], [-1, 1], [-1, 1], [2, 3], [2, -1], [2, -1]]
    assert [c.latency_steps for c in run.completions] == [2, 5, 8, 6]


def test_a_request_done_at_its_first_token_frees_its_slot_for_the_next_step():
    """Request 1 stops at its first token, request 2 wants none (it takes no slot): request 3 takes slot 1 at the
    next step."""
    jobs = [job(0, 6), job(1, 5, stops={9}), job(2, 0), job(3, 3)]
    run = drive(jobs, 2, "continuous", token=lambda j: 9 if j.id == 1 else 7)
    assert [c.admitted for c in run.completions] == [0, 0, 1, 1]
    assert [c.slot for c in run.completions] == [0, 1, -1, 1]
    assert run.timeline[:2] == [[0, 1], [0, 3]]
    assert (run.completions[1].tokens, run.completions[1].stop_reason) == ([9], "stop")
    assert (run.completions[2].tokens, run.completions[2].stop_reason) == ([], "length")
    static = drive([job(0, 6), job(1, 5, stops={9}), job(2, 0), job(3, 3)], 2, "static",
                   token=lambda j: 9 if j.id == 1 else 7)
    assert [c.admitted for c in static.completions] == [0, 0, 6, 6]  # a static batch is formed once


def test_idle_steps_until_a_late_arrival_and_the_clock():
    run = drive([job(0, 2), job(1, 2, arrival=6)], 2, "continuous")
    assert run.timeline[2:6] == [[-1, -1]] * 4 and run.step_seconds[2:6] == [0.0] * 4
    assert run.completions[1].admitted == 6 and run.completions[1].queued_steps == 0
    c = run.completions[0]
    assert c.first_token_seconds > 0 and c.latency_seconds > c.first_token_seconds  # read from the given clock


def test_the_end_of_a_slot_ends_a_request():
    run = drive([job(0, 30, prompt_len=40)], 1, "continuous")
    c = run.completions[0]
    assert (len(c.tokens), c.stop_reason) == (MAX_LEN - 40 + 1, "context")


def test_fifo_within_and_across_arrival_steps():
    jobs = [job(0, 4, arrival=2), job(1, 4, arrival=0), job(2, 4, arrival=2), job(3, 4, arrival=0)]
    run = drive(jobs, 1, "continuous")
    order = sorted(run.completions, key=lambda c: c.admitted)
    assert [c.id for c in order] == [1, 3, 0, 2]


def test_an_unknown_policy_is_named():
    with pytest.raises(ValueError, match="unknown batching policy 'fifo'"):
        Scheduler([], 2, KVCacheManager(2, MAX_LEN), policy="fifo")
    assert drive([], 2, "continuous").steps == 0


def test_dry_run_is_the_loop_the_engines_drive():
    jobs = [job(i, n, arrival=i % 3) for i, n in enumerate((2, 5, 3, 1, 7, 4))]
    ticks = iter(range(10**6))
    dry = Scheduler(jobs, 2, KVCacheManager(2, MAX_LEN), clock=lambda: float(next(ticks))).dry_run(7)
    again = drive([job(i, n, arrival=i % 3) for i, n in enumerate((2, 5, 3, 1, 7, 4))], 2, "continuous")
    assert dry.timeline == again.timeline and dry.prefills == again.prefills and dry.tokens == again.tokens == 22


class TensorCalls:
    """Every torch function and Tensor method called from Python inside the block (torch.overrides' public mode)."""

    def __enter__(self):
        from torch.overrides import TorchFunctionMode

        calls = self.calls = []

        class Record(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                calls.append(getattr(func, "__name__", repr(func)))
                return func(*args, **(kwargs or {}))

        self.mode = Record()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def test_the_record_of_tensor_calls_sees_one():
    import torch

    with TensorCalls() as seen:
        torch.ones(2).sum()
    assert seen.calls == ["ones", "sum"]


def test_the_schedulers_run_a_whole_workload_without_a_tensor_operation():
    """Continuous, static and paged scheduling, admission to the last token (with preemption in the paged run),
    make no torch call: the scheduler is bookkeeping over ids and counts, the model runner owns the tensors."""
    from llmstep.lab.bench_batching import random_workload, schedule_capacity

    requests = random_workload(12, 300, prompt_len=(4, 12), new_tokens=(2, 30), seed=1)  # made with torch: outside
    with TensorCalls() as seen:
        runs = [drive([job(i, n, arrival=i % 3) for i, n in enumerate((2, 5, 3, 1, 7, 4))], 2, policy)
                for policy in ("continuous", "static")]
        paged = schedule_capacity(requests, MAX_LEN, contiguous_slots=2, block_size=4)
    assert seen.calls == []
    assert all(r.tokens == 22 for r in runs) and paged["paged_steps"] > 0 and paged["preemptions"] > 0
