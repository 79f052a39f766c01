"""The container's memory and CPU limits, read from cgroup files laid out as v2 and v1 write them."""

from __future__ import annotations

from pathlib import Path

from sluice_common.cgroup import cpu_limit, memory_limit, usable_cpus


def cgroup(tmp_path: Path, files: dict[str, str], self_line: str = "0::/\n") -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    root.mkdir(exist_ok=True)
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(content)
    proc = tmp_path / "self_cgroup"
    proc.write_text(self_line)
    return root, proc


# -- memory ----------------------------------------------------------------------------------


def test_the_memory_limit_comes_from_cgroup_v2(tmp_path: Path) -> None:
    root, proc = cgroup(tmp_path, {"memory.max": "1073741824\n"})
    assert memory_limit(root, proc) == 1 << 30


def test_cgroup_v2_max_is_no_memory_limit(tmp_path: Path) -> None:
    root, proc = cgroup(tmp_path, {"memory.max": "max\n"})
    assert memory_limit(root, proc) is None


def test_the_process_own_cgroup_v2_is_read_first(tmp_path: Path) -> None:
    root, proc = cgroup(tmp_path, {"memory.max": "max\n", "kubepods/pod1/memory.max": str(512 << 20)}, self_line="0::/kubepods/pod1\n")
    assert memory_limit(root, proc) == 512 << 20


def test_the_memory_limit_comes_from_cgroup_v1(tmp_path: Path) -> None:
    root, proc = cgroup(tmp_path, {"memory/memory.limit_in_bytes": "2147483648\n"}, self_line="4:memory:/\n")
    assert memory_limit(root, proc) == 2 << 30


def test_cgroup_v1_unlimited_is_no_memory_limit(tmp_path: Path) -> None:
    root, proc = cgroup(tmp_path, {"memory/memory.limit_in_bytes": "9223372036854771712\n"})
    assert memory_limit(root, proc) is None


def test_no_cgroup_files_is_no_limit(tmp_path: Path) -> None:
    assert memory_limit(tmp_path / "absent", tmp_path / "absent-too") is None
    assert cpu_limit(tmp_path / "absent", tmp_path / "absent-too") is None


# -- CPU -------------------------------------------------------------------------------------


def test_the_cpu_limit_comes_from_cgroup_v2(tmp_path: Path) -> None:
    root, proc = cgroup(tmp_path, {"cpu.max": "250000 100000\n"})
    assert cpu_limit(root, proc) == 2.5


def test_cgroup_v2_max_is_no_cpu_limit(tmp_path: Path) -> None:
    root, proc = cgroup(tmp_path, {"cpu.max": "max 100000\n"})
    assert cpu_limit(root, proc) is None


def test_the_process_own_cpu_max_is_read_first(tmp_path: Path) -> None:
    root, proc = cgroup(tmp_path, {"cpu.max": "max 100000\n", "kubepods/pod1/cpu.max": "200000 100000\n"}, self_line="0::/kubepods/pod1\n")
    assert cpu_limit(root, proc) == 2.0


def test_the_cpu_limit_comes_from_cgroup_v1(tmp_path: Path) -> None:
    root, proc = cgroup(tmp_path, {"cpu/cpu.cfs_quota_us": "150000\n", "cpu/cpu.cfs_period_us": "100000\n"}, self_line="1:cpu:/\n")
    assert cpu_limit(root, proc) == 1.5


def test_cgroup_v1_quota_minus_one_is_no_cpu_limit(tmp_path: Path) -> None:
    root, proc = cgroup(tmp_path, {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert cpu_limit(root, proc) is None


def test_usable_cpus_is_the_quota_rounded_down_when_below_the_cores(tmp_path: Path) -> None:
    root, proc = cgroup(tmp_path, {"cpu.max": "250000 100000\n"})
    cpus, source = usable_cpus(root, proc, affinity=64)
    assert cpus == 2 and "CPU limit (2.5 CPUs)" in source


def test_usable_cpus_is_at_least_one_under_a_fractional_quota(tmp_path: Path) -> None:
    root, proc = cgroup(tmp_path, {"cpu.max": "50000 100000\n"})
    assert usable_cpus(root, proc, affinity=8)[0] == 1


def test_usable_cpus_is_the_cores_when_the_quota_is_larger_or_absent(tmp_path: Path) -> None:
    root, proc = cgroup(tmp_path, {"cpu.max": "800000 100000\n"})
    assert usable_cpus(root, proc, affinity=4) == (4, "the 4 cores this process may run on")
    root, proc = cgroup(tmp_path, {"cpu.max": "max 100000\n"})
    assert usable_cpus(root, proc, affinity=4)[0] == 4
