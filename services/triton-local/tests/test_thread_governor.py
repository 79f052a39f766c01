"""The engine's thread count follows whether it has the cores to itself (engine/thread_governor.py):
fewer threads once the stepping thread loses its core, all of them again once the box has cores idle."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest

from sluice_triton_local.engine.llamacpp_model import LlamaCppModel
from sluice_triton_local.engine.model import BatchItem
from sluice_triton_local.engine.thread_governor import CONTENDED, FIRST_WINDOW_S, HOLD_S, IDLE_SPELL_S, RECENT_S, WINDOW_S, RecentIdle, ThreadGovernor
from sluice_triton_local.model_files import smollm2_gguf


class Box:
    """A clock and the box's idle seconds, advanced by hand."""

    def __init__(self) -> None:
        self.now = 100.0
        self.idle = 0.0
        self.recent_idle_cores = 2.0  # what the box did just before now

    def spend(self, seconds: float, idle_cores: float) -> None:
        self.now += seconds
        self.idle += seconds * idle_cores


def governor(box: Box, threads: int = 2) -> ThreadGovernor:
    return ThreadGovernor(threads, idle_seconds=lambda: box.idle, recent_idle_cores=lambda: box.recent_idle_cores, clock=lambda: box.now)


def decode(g: ThreadGovernor, box: Box, seconds: float, share: float, idle_cores: float = 0.0) -> int:
    """A decode of `seconds` in which the stepping thread had its core `share` of the time."""
    assert g.before_decode() == g.current
    box.spend(seconds, idle_cores)
    return g.after_decode(seconds, seconds * share)


def test_a_quiet_box_keeps_every_thread() -> None:
    box = Box()
    g = governor(box)
    for _ in range(100):
        assert decode(g, box, 0.05, share=0.95) == 2


def test_a_window_of_contended_decodes_drops_a_thread_and_says_why() -> None:
    box = Box()
    g = governor(box)
    threads = [decode(g, box, 0.1, share=0.5) for _ in range(round(WINDOW_S / 0.1) + 1)]
    assert threads[0] == 2 and threads[-1] == 1  # judged over a window, not one decode
    assert "50%" in g.last_reason


def test_never_fewer_than_one_thread() -> None:
    box = Box()
    g = governor(box, threads=3)
    for _ in range(100):
        decode(g, box, 0.1, share=0.3)
    assert g.current == 1


def test_threads_come_back_once_the_box_leaves_cores_idle_after_the_hold() -> None:
    box = Box()
    g = governor(box)
    while g.current == 2:
        decode(g, box, 0.1, share=0.5)
    dropped_at = box.now
    # The other process still runs: one thread computes, nothing idle.
    for _ in range(30):
        assert decode(g, box, 0.1, share=1.0, idle_cores=0.05) == 1
    # It ended: a core idle, but the lower count holds for a while after a drop.
    while box.now < dropped_at + HOLD_S - WINDOW_S:
        assert decode(g, box, 0.1, share=1.0, idle_cores=0.9) == 1
    for _ in range(2 * round(WINDOW_S / 0.1)):
        decode(g, box, 0.1, share=1.0, idle_cores=0.9)
    assert g.current == 2 and "0.9 cores idle" in g.last_reason


def test_after_an_idle_spell_it_starts_from_the_cores_the_box_left_idle_just_before() -> None:
    box = Box()
    g = governor(box)
    decode(g, box, 0.05, share=0.95)
    box.spend(IDLE_SPELL_S * 4, idle_cores=0.0)  # something else took every core meanwhile ...
    box.recent_idle_cores = 1.0  # ... and one of them still
    assert g.before_decode() == 1 and "1.0 cores idle" in g.last_reason
    box.spend(0.05, 0.0)
    g.after_decode(0.05, 0.05)
    box.spend(IDLE_SPELL_S * 4, idle_cores=0.0)  # a benchmark's other side, say, that has just ended
    box.recent_idle_cores = 1.8
    assert g.before_decode() == 2


def test_after_an_idle_spell_begun_with_fewer_threads_a_short_window_gives_them_back() -> None:
    box = Box()
    g = governor(box)
    decode(g, box, 0.05, share=0.95)
    box.spend(IDLE_SPELL_S * 4, idle_cores=0.0)
    box.recent_idle_cores = 1.0  # the tail of a burst that ends as the engine steps again
    assert g.before_decode() == 1
    box.spend(0.05, 0.0)
    g.after_decode(0.05, 0.05)
    threads = [decode(g, box, 0.05, share=1.0, idle_cores=0.9) for _ in range(round(FIRST_WINDOW_S / 0.05))]
    assert threads[-1] == 2 and threads[0] == 1


def test_pauses_between_requests_are_no_idle_spell() -> None:
    box = Box()
    g = governor(box)
    decode(g, box, 0.05, share=0.95)
    box.spend(IDLE_SPELL_S / 5, idle_cores=0.5)  # the next request on its way: the services took the cores
    box.recent_idle_cores = 0.5
    assert g.before_decode() == 2


def test_the_contention_threshold_sits_between_a_quiet_box_and_a_busy_one() -> None:
    # Measured on 2-core VMs: 0.93-0.98 quiet at 1 and 32 streams, 0.45-0.52 beside one busy process.
    assert 0.52 < CONTENDED < 0.93


def test_the_recent_idle_cores_are_read_from_the_box() -> None:
    recent = RecentIdle()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(RECENT_S + 0.2)
        idle_cores = recent()
    finally:
        busy.kill()
        busy.wait()
    # The busy process kept one of the box's cores from idling.
    assert 0.0 <= idle_cores <= os.cpu_count() - 0.5


def test_a_change_reaches_llama_cpp_and_its_log_names_the_model(caplog: pytest.LogCaptureFixture) -> None:
    """triton-local steps two models in one process (its Q4_0 variant beside the main one), each
    judged by a governor of its own: the log line says whose threads changed."""
    model = LlamaCppModel(str(smollm2_gguf()), max_slots=1, max_context=64, threads=2, adaptive_threads=True)
    try:
        box = Box()
        model._governor = governor(box)  # the box advanced by hand, not /proc/stat and the clock
        model.forward([BatchItem(0, [1, 504, 3458], 0)])
        box.now += IDLE_SPELL_S  # an idle spell, and no core idle on the box just before the next decode
        box.recent_idle_cores = 0.0
        with caplog.at_level(logging.INFO, logger="sluice.triton_local.engine"):
            model.forward([BatchItem(0, [282], 3)])
        assert model.threads_in_use == 1
        assert f"engine_threads_changed: {smollm2_gguf().name} 2 -> 1 of 2 (0.0 cores idle" in caplog.text
    finally:
        model.close()
