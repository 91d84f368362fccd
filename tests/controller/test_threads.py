"""The thread governor keeps the configured thread count on a quiet host, moves to one thread
when the configured count runs slower than one would (a busy neighbour stalling ggml's spinning
barriers), and comes back when the neighbour leaves."""

from __future__ import annotations

from edgespec.controller.threads import ThreadGovernor


def run(gov: ThreadGovernor, ratio_by_threads, ticks: int) -> list[int]:
    used = []
    for _ in range(ticks):
        n = gov.choose()
        used.append(n)
        gov.record(n, ratio_by_threads[n] * 0.01, 0.01)
    return used


def test_a_quiet_host_keeps_the_configured_count_and_probes_rarely():
    gov = ThreadGovernor(2)
    used = run(gov, {2: 1.0, 1: 1.9}, 2000)
    assert used[-1] == 2
    assert used.count(1) / len(used) < 0.05  # probes only


def test_a_busy_host_moves_to_one_thread_and_back():
    gov = ThreadGovernor(2)
    run(gov, {2: 1.0, 1: 1.9}, 50)
    busy = run(gov, {2: 8.0, 1: 2.0}, 200)  # a neighbour holds a core: two threads stall
    assert busy[-100:].count(1) >= 90
    quiet = run(gov, {2: 1.0, 1: 1.9}, 600)  # the neighbour left: the probes find two threads again
    assert quiet[-100:].count(2) >= 90


def test_one_configured_thread_never_changes():
    gov = ThreadGovernor(1)
    assert set(run(gov, {1: 5.0}, 100)) == {1}
    gov = ThreadGovernor(2, enabled=False)
    assert set(run(gov, {2: 9.0}, 100)) == {2}
