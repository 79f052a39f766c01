"""Owner tasks under supervision: a death is reported, its waiters failed, the task restarted."""

from __future__ import annotations

import asyncio

import pytest

from sluice_common.supervision import TASK_DEATHS, Supervisor, stop_tasks


class Health:
    def __init__(self) -> None:
        self.reports: list[tuple[str, bool]] = []

    async def report(self, source: str, ok: bool) -> None:
        self.reports.append((source, ok))


async def wait_until(condition, timeout_s: float = 2.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


async def test_a_task_that_raises_is_reported_its_waiters_failed_and_it_restarts() -> None:
    health, deaths, runs = Health(), [], []

    async def owner() -> None:
        runs.append(1)
        if len(runs) == 1:
            raise KeyError("a bug in the loop")
        await asyncio.Event().wait()

    supervisor = Supervisor(health.report, restart_delay_s=0.05)
    before = TASK_DEATHS.labels(task="scheduler")._value.get()
    task = supervisor.start("scheduler", owner, on_death=deaths.append)
    await wait_until(lambda: len(runs) == 2)
    assert isinstance(deaths[0], KeyError)
    assert health.reports == [("task:scheduler", False), ("task:scheduler", True)]
    assert supervisor.healthy and TASK_DEATHS.labels(task="scheduler")._value.get() == before + 1
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert health.reports[-1] == ("task:scheduler", True)  # stopping is not dying


async def test_health_is_down_while_the_task_waits_to_restart() -> None:
    health = Health()

    async def owner() -> None:
        raise RuntimeError("boom")

    supervisor = Supervisor(health.report, restart_delay_s=10.0)
    task = supervisor.start("batcher", owner)
    await wait_until(lambda: health.reports == [("task:batcher", False)])
    assert not supervisor.healthy
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_loop_that_returns_has_ended_and_one_not_restarted_stays_down() -> None:
    deaths: list[BaseException] = []

    async def drains_and_ends() -> None:
        return None

    async def fails() -> None:
        raise OSError("the broker went away")

    supervisor = Supervisor()
    await supervisor.start("similarity", drains_and_ends, on_death=deaths.append, restart=False)
    assert deaths == [] and supervisor.healthy
    await supervisor.start("consumer", fails, on_death=deaths.append, restart=False)
    assert isinstance(deaths[0], OSError) and not supervisor.healthy


async def test_a_failing_on_death_does_not_stop_the_restart() -> None:
    runs = []

    async def owner() -> None:
        runs.append(1)
        if len(runs) == 1:
            raise RuntimeError("first run fails")
        await asyncio.Event().wait()

    def on_death(_: BaseException) -> None:
        raise ValueError("the waiters could not be failed")

    task = Supervisor(restart_delay_s=0.01).start("probe", owner, on_death=on_death)
    await wait_until(lambda: len(runs) == 2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_an_injected_fault_kills_only_the_named_tasks_like_a_real_death() -> None:
    health, deaths, runs = Health(), [], {"scheduler@a": 0, "probes": 0}

    def owner(name: str):  # type: ignore[no-untyped-def]
        async def run() -> None:
            runs[name] += 1
            await asyncio.Event().wait()

        return run

    supervisor = Supervisor(health.report, restart_delay_s=0.05, fault_injection=("scheduler",))
    tasks = [supervisor.start(name, owner(name), on_death=deaths.append) for name in runs]
    await wait_until(lambda: all(runs.values()))
    supervisor.inject_faults()
    await wait_until(lambda: runs["scheduler@a"] == 2)
    assert [type(d).__name__ for d in deaths] == ["InjectedFault"]
    assert health.reports == [("task:scheduler@a", False), ("task:scheduler@a", True)]
    assert runs["probes"] == 1 and supervisor.healthy
    for task in tasks:  # a stop is still not a death
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert len(deaths) == 1


async def test_without_fault_injection_nothing_is_injected() -> None:
    supervisor = Supervisor(restart_delay_s=0.05)
    started = asyncio.Event()

    async def run() -> None:
        started.set()
        await asyncio.Event().wait()

    task = supervisor.start("scheduler", run)
    await started.wait()
    supervisor.inject_faults()
    await asyncio.sleep(0.05)
    assert not task.done() and supervisor.healthy
    task.cancel()


async def test_stop_tasks_ends_a_loop_that_swallowed_a_cancel() -> None:
    swallowed = []

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if not swallowed:  # what a cancel lost in a wait_for race looks like to the loop
                    swallowed.append(1)
                    continue
                raise

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await asyncio.wait_for(stop_tasks(task, None, retry_s=0.05), 2)
    assert task.cancelled() and swallowed == [1]
