"""The engine's thread count follows the CPUs the process can keep busy, and more threads than
those is reported: llama.cpp's spinning threads stall every step when they outnumber the CPUs."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

import sluice_triton_local.__main__ as entry
import sluice_triton_local.config as config_module
from sluice_triton_local import metrics
from sluice_triton_local.config import TritonLocalConfig


def test_zero_threads_means_the_usable_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_module, "usable_cpus", lambda: (3, "the container's CPU limit (3.5 CPUs)"))
    assert TritonLocalConfig(threads=0).engine_threads() == 3
    assert TritonLocalConfig(threads=5).engine_threads() == 5  # set explicitly: kept, and warned about below


def test_more_threads_than_cpus_is_a_warning_that_names_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(entry, "usable_cpus", lambda: (2, "the container's CPU limit (2 CPUs)"))
    with capture_logs() as logs:
        entry.report_threads(TritonLocalConfig(threads=4))
    (warning,) = [entry for entry in logs if entry["event"] == "engine_threads_exceed_cpus"]
    assert warning["log_level"] == "warning" and warning["threads"] == 4 and warning["usable_cpus"] == 2
    assert "SLUICE_TRITON_LOCAL_THREADS to 2" in warning["hint"]
    assert metrics.ENGINE_THREADS._value.get() == 4 and metrics.USABLE_CPUS._value.get() == 2


def test_threads_within_the_cpus_are_logged_without_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(entry, "usable_cpus", lambda: (2, "the 2 cores this process may run on"))
    with capture_logs() as logs:
        entry.report_threads(TritonLocalConfig(threads=1))
    assert [entry["event"] for entry in logs] == ["engine_threads"]
    assert logs[0]["usable_cpus"] == 2 and logs[0]["threads"] == 1


@pytest.mark.parametrize(
    ("environ", "adaptive", "expected"),
    [
        ({}, True, {}),  # libgomp's own wait: the governor steps with fewer threads on a busy box
        ({}, False, {"GOMP_SPINCOUNT": "1000"}),  # every thread always: a brief spin, then sleep
        ({"GOMP_SPINCOUNT": "5000"}, False, {"GOMP_SPINCOUNT": "5000"}),  # the operator's spin
        ({"GOMP_SPINCOUNT": "5000"}, True, {"GOMP_SPINCOUNT": "5000"}),
        ({"OMP_WAIT_POLICY": "ACTIVE"}, False, {"OMP_WAIT_POLICY": "ACTIVE"}),  # the operator's policy alone
        ({"OMP_WAIT_POLICY": "PASSIVE"}, False, {"OMP_WAIT_POLICY": "PASSIVE"}),
    ],
)
def test_thread_waits_are_libgomps_with_adaptive_threads_else_a_brief_spin_unless_the_operator_set_them(
    environ: dict[str, str], adaptive: bool, expected: dict[str, str]
) -> None:
    entry.default_thread_waits(environ, adaptive)
    assert environ == expected


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, {"PYTRITON_NO_TENSORSTORE": "1"}),  # tensors inline in PyTriton's messages
        ({"PYTRITON_NO_TENSORSTORE": ""}, {"PYTRITON_NO_TENSORSTORE": ""}),  # the operator's shared-memory store
    ],
)
def test_tensors_travel_inline_unless_the_operator_set_the_transport(environ: dict[str, str], expected: dict[str, str]) -> None:
    entry.default_tensor_transport(environ)
    assert environ == expected
