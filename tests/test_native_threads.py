"""How many threads the native decode step runs on (pagedchat/native/step.py ThreadChoice), driven by a
simulated machine: each option's step time and whether its threads had their cores."""

from __future__ import annotations

from pagedchat.native.step import ThreadChoice

QUIET = {2: (0.004, 1.0), 1: (0.008, 1.0)}   # threads -> (seconds per step, CPU use per thread)
BUSY = {2: (0.0097, 0.5), 1: (0.0087, 1.0)}  # beside a CPU burner on 2 cores (measured shapes)


def run(choice: ThreadChoice, machine: dict, steps: int, batch: int = 1) -> list[int]:
    picked = []
    for _ in range(steps):
        threads = choice.pick(batch)
        seconds, use = machine[threads]
        choice.record(batch, threads, seconds, seconds * threads * use)
        picked.append(threads)
    return picked


def test_a_quiet_machine_keeps_every_thread_and_spends_almost_nothing_on_trials():
    picked = run(ThreadChoice(2), QUIET, 3000)
    assert picked.count(1) <= 3 * ThreadChoice.TRIAL_STEPS  # one trial per MAX_INTERVAL steps at most
    assert picked[:ThreadChoice.MAX_INTERVAL - 1] == [2] * (ThreadChoice.MAX_INTERVAL - 1)


def test_a_busy_machine_moves_to_the_faster_single_thread_within_a_few_steps():
    picked = run(ThreadChoice(2), BUSY, 400)
    assert picked[20:].count(2) / len(picked[20:]) < 0.1
    assert picked[-50:].count(1) >= 45


def test_it_follows_the_machine_both_ways():
    choice = ThreadChoice(2)
    run(choice, BUSY, 100)
    assert choice.batches[1].best == 1
    picked = run(choice, QUIET, 400)
    assert picked[-100:] == [2] * 100  # back on both cores once they are free
    picked = run(choice, BUSY, 100)
    assert picked[-50:].count(1) >= 45  # and off again: low CPU use starts a trial at once


def test_each_batch_size_is_measured_on_its_own():
    choice = ThreadChoice(2)
    run(choice, BUSY, 100, batch=1)
    assert run(choice, QUIET, 50, batch=16) == [2] * 50


def test_budgets():
    assert run(ThreadChoice(1), QUIET, 10) == [1] * 10
    assert ThreadChoice(8).options == [8, 4, 1]
