"""What this process's container grants it: its memory limit and its CPUs, read from cgroups.

cgroup v2 files are read from the process's own cgroup (the `0::<path>` line of
/proc/self/cgroup, under the root), else from the root itself (a container with its own cgroup
namespace sees its cgroup there); cgroup v1 files from the root's controller folders.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

DEFAULT_CGROUP_ROOT = Path("/sys/fs/cgroup")
DEFAULT_SELF_CGROUP = Path("/proc/self/cgroup")
# cgroup v1 writes "no limit" as a page-rounded 2**63 - 1; anything this large is no limit.
_UNLIMITED_BYTES = 1 << 60


def _candidates(name: str, v1_names: tuple[str, ...], root: Path, self_cgroup: Path) -> list[Path]:
    """Where `name` (a v2 file) or its v1 equivalents may be, most specific first."""
    paths: list[Path] = []
    try:
        for line in self_cgroup.read_text().splitlines():
            if line.startswith("0::"):
                relative = line[3:].strip().lstrip("/")
                if relative:
                    paths.append(root / relative / name)
    except OSError:
        pass
    return [*paths, root / name, *(root / v1 for v1 in v1_names)]


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def memory_limit(root: Path = DEFAULT_CGROUP_ROOT, self_cgroup: Path = DEFAULT_SELF_CGROUP) -> int | None:
    """The memory limit in bytes, None when there is none (v2 `memory.max` "max", v1
    `memory.limit_in_bytes` near 2**63, or no cgroup files at all)."""
    for path in _candidates("memory.max", ("memory/memory.limit_in_bytes",), root, self_cgroup):
        raw = _read(path)
        if raw is None:
            continue
        if raw == "max":
            return None
        try:
            value = int(raw)
        except ValueError:
            continue
        return None if value >= _UNLIMITED_BYTES else value
    return None


def cpu_limit(root: Path = DEFAULT_CGROUP_ROOT, self_cgroup: Path = DEFAULT_SELF_CGROUP) -> float | None:
    """The CPU quota in CPUs (Kubernetes' `limits.cpu`), None when there is none: v2 `cpu.max`
    ("<quota> <period>", "max <period>" for none), v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`
    (a quota of -1 for none)."""
    for path in _candidates("cpu.max", (), root, self_cgroup):
        raw = _read(path)
        if raw is None:
            continue
        quota, _, period = raw.partition(" ")
        if quota == "max":
            return None
        try:
            return int(quota) / int(period or "100000")
        except (ValueError, ZeroDivisionError):
            continue
    for folder in ("cpu", "cpu,cpuacct"):
        raw_quota, raw_period = _read(root / folder / "cpu.cfs_quota_us"), _read(root / folder / "cpu.cfs_period_us")
        if raw_quota is None or raw_period is None:
            continue
        try:
            v1_quota, v1_period = int(raw_quota), int(raw_period)
        except ValueError:
            continue
        return None if v1_quota <= 0 or v1_period <= 0 else v1_quota / v1_period
    return None


def usable_cpus(root: Path = DEFAULT_CGROUP_ROOT, self_cgroup: Path = DEFAULT_SELF_CGROUP, affinity: int | None = None) -> tuple[int, str]:
    """(the CPUs this process can keep busy at once, where that figure comes from): the cores it
    may run on, lowered by a CPU quota (rounded down, at least 1). In a pod with `limits.cpu: 2` on
    a 64-core node the affinity says 64 and the quota 2: 64 busy threads would be throttled."""
    cores = affinity if affinity is not None else len(os.sched_getaffinity(0))
    quota = cpu_limit(root, self_cgroup)
    if quota is not None and math.floor(quota) < cores:
        return max(1, math.floor(quota)), f"the container's CPU limit ({quota:g} CPUs)"
    return cores, f"the {cores} cores this process may run on"
