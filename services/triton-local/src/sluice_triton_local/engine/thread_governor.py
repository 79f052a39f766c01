"""How many of its threads the engine computes a step with: all of them while it has the cores to
itself, fewer while another process takes some.

llama.cpp's threads meet at each of a step's hundreds of barriers and wait there as libgomp does by
default, as llama-server's do: spinning a few milliseconds, then sleeping. That is the fastest wait on
a quiet box (a batch-1 token in 13.6 ms alone on a 2-core VM, against 16.8 with a 1,000-round spin
and 40 with 100), but beside a busy process a thread that lost its core holds the others spinning at
every barrier, and a step that takes 20 ms takes seconds. So the governor watches every decode: the
CPU time of the thread that calls llama_decode (one of the team, spinning included) over the
decode's wall time is near 1 while the team has its cores and about half once another process takes
one. Below CONTENDED over a window of decoding, the engine steps with one thread fewer (no team at
all at one thread: nothing to wait for); while it runs with fewer, a window in which the box left
half a core idle gives one back. After an idle spell (nothing to measure) it starts from what the
box did just before: as many threads as it left cores idle.

Plain logic, no llama.cpp: the caller times the decodes and applies the count (llamacpp_model.py).
The box's idle time is /proc/stat's, host-wide: a container's CPU limit is not seen there, so after a
drop the governor holds the lower count for a while before it tries more again.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable

# The calling thread's CPU over wall time under which a window of decoding counts as contended:
# 0.93-0.98 measured on a quiet 2-core box at 1 and 32 streams, 0.45-0.52 beside one busy process.
CONTENDED = 0.6
# Decoding wall time a judgement rests on; after an idle spell that began with fewer threads, the
# first one that may give threads back is shorter: the box's recent past may have been a burst that
# has ended (a benchmark's other side), and with a core idle the engine would wait a window at half
# its pace for nothing.
WINDOW_S = 1.0
FIRST_WINDOW_S = 0.2
# Idle cores over a window that give a thread back.
IDLE_CORE_TO_GROW = 0.5
# A pause between decodes longer than this is an idle spell, after which the box's recent idle
# time decides: what it did just before the decode, not while the engine waited (a benchmark's other
# side, say, that has just ended).
IDLE_SPELL_S = 0.5
RECENT_S = 0.3
# After a drop, how long the lower count holds before a window may give a thread back.
HOLD_S = 5.0

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def box_idle_seconds() -> float:
    """The seconds every CPU of the box has been idle (idle + iowait of /proc/stat's first line)."""
    with open("/proc/stat", encoding="ascii") as stat:
        fields = stat.readline().split()
    return (int(fields[4]) + int(fields[5])) / _CLOCK_TICKS


class RecentIdle:
    """The box's idle cores over the last RECENT_S or so, from /proc/stat read every 0.1 s by a
    thread of its own (a few microseconds ten times a second)."""

    def __init__(self, period_s: float = 0.1) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=round(RECENT_S / period_s) + 1)
        self._period_s = period_s
        self._samples.append((time.monotonic(), box_idle_seconds()))
        threading.Thread(target=self._sample, name="box-idle-sampler", daemon=True).start()

    def _sample(self) -> None:
        while True:
            time.sleep(self._period_s)
            self._samples.append((time.monotonic(), box_idle_seconds()))

    def __call__(self) -> float:
        now, idle = time.monotonic(), box_idle_seconds()
        then, idle_then = self._samples[0]
        return (idle - idle_then) / max(now - then, 1e-3)


class ThreadGovernor:
    def __init__(
        self,
        threads: int,
        *,
        idle_seconds: Callable[[], float] = box_idle_seconds,
        recent_idle_cores: Callable[[], float] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.configured = threads
        self._recent_idle_cores = recent_idle_cores or RecentIdle()
        self.current = threads
        self._idle_seconds = idle_seconds
        self._clock = clock
        self._wall = 0.0
        self._cpu = 0.0
        self._window_start = (clock(), idle_seconds())
        self._last_end: float | None = None  # when the last decode ended
        self._hold_until = float("-inf")
        self._window_s = WINDOW_S
        self.last_reason = ""

    def before_decode(self) -> int:
        """The threads for the decode about to run."""
        if self._last_end is None:
            return self.current
        now = self._clock()
        if now - self._last_end >= IDLE_SPELL_S:
            idle_cores = self._recent_idle_cores()
            self._set(max(1, min(self.configured, int(idle_cores + 0.5))), f"{idle_cores:.1f} cores idle before the engine stepped again")
            self._window_start, self._wall, self._cpu = (now, self._idle_seconds()), 0.0, 0.0
            self._window_s = FIRST_WINDOW_S if self.current < self.configured else WINDOW_S
        return self.current

    def after_decode(self, wall_s: float, cpu_s: float) -> int:
        """Records a decode's wall time and its calling thread's CPU time; the threads from now on."""
        now = self._clock()
        self._last_end = now
        self._wall += wall_s
        self._cpu += cpu_s
        if self._wall < self._window_s:
            return self.current
        idle_now = self._idle_seconds()  # /proc/stat once a window, not once a decode
        share = self._cpu / self._wall
        started_at, idle_then = self._window_start
        idle_cores = (idle_now - idle_then) / max(now - started_at, 1e-9)
        if self.current > 1 and share < CONTENDED:
            self._set(self.current - 1, f"the stepping thread had its core {share:.0%} of the time")
            self._hold_until = now + HOLD_S
        elif self.current < self.configured and idle_cores >= IDLE_CORE_TO_GROW and now >= self._hold_until:
            self._set(self.current + 1, f"{idle_cores:.1f} cores idle")
        self._window_start, self._wall, self._cpu, self._window_s = (now, idle_now), 0.0, 0.0, WINDOW_S
        return self.current

    def _set(self, threads: int, reason: str) -> None:
        if threads != self.current:
            self.current = threads
            self.last_reason = reason
