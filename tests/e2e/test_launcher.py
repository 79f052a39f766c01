"""The local launcher (sluice_stack) honours a service's drain and leaks nothing across restarts
(issue 22, item 5); the services bind the ports they report, and a Triton port taken after its
probe moves triton-local to other ones (item 11); services die with a launcher killed without its
cleanup (their lifeline), and a second Ctrl-C during a stop still stops every tier.

A stream is held open by freezing (SIGSTOP) the adapter behind a gateway of the test's own after
its first token: the gateway then waits on the adapter for as long as the drain lets it."""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conftest import DEMO_KEY, MODEL, wait_for
from sluice_stack import REPO_ROOT, ServiceProcess, Stack, StackPorts
from sluice_stack import launcher
from sluice_stack.keeper import ServiceKeeper
from sluice_stack.launcher import ANY_HTTP_PORT, RATELIMIT_PORT_ENV, STOP_MARGIN_S

GRACE_S = 20.0


class HeldStream:
    """One streamed chat completion over the OpenAI HTTP front, read on its own thread."""

    def __init__(self, base_url: str) -> None:
        self.first_chunk = threading.Event()
        self.ended = threading.Event()
        self._base_url = base_url
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        body = {"model": MODEL, "stream": True, "max_tokens": 1000, "messages": [{"role": "user", "content": "Tell a long story."}]}
        request = urllib.request.Request(
            f"{self._base_url}/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {DEMO_KEY}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=300) as reply:
                for line in reply:
                    if line.startswith(b"data: {"):
                        self.first_chunk.set()
        except OSError:
            pass
        finally:
            self.ended.set()
            self.first_chunk.set()


@pytest.fixture(scope="module")
def adapter(stack: Stack) -> Iterator[ServiceProcess]:
    """An adapter of these tests' own, which they freeze to hold a gateway's stream open."""
    service, _, _ = stack.add_adapter("adapter-launcher-tests")
    yield service
    service.kill()


@pytest.fixture()
def held_gateway(stack: Stack, adapter: ServiceProcess, request: pytest.FixtureRequest) -> Iterator[tuple[ServiceProcess, HeldStream]]:
    """A gateway (drain grace GRACE_S) with one HTTP stream open that its frozen adapter never ends."""
    assert adapter.process is not None
    gateway, _, _ = stack.add_gateway(
        f"gateway-{request.node.name[:40]}",
        env={
            "SLUICE_GATEWAY_ADAPTER_URL": adapter.address,
            "SLUICE_GATEWAY_HTTP_PORT": str(ANY_HTTP_PORT),
            "SLUICE_GATEWAY_SHUTDOWN_GRACE_S": str(GRACE_S),
        },
    )
    stream = HeldStream(f"http://127.0.0.1:{gateway.ports['http']}/v1")
    try:
        assert stream.first_chunk.wait(120) and not stream.ended.is_set(), "the stream did not start"
        os.kill(adapter.process.pid, signal.SIGSTOP)
        yield gateway, stream
    finally:
        os.kill(adapter.process.pid, signal.SIGCONT)
        gateway.kill()


def test_stop_waits_the_service_drain_grace_before_it_kills(
    held_gateway: tuple[ServiceProcess, HeldStream], record_property: Callable[[str, object], None]
) -> None:
    gateway, stream = held_gateway
    assert gateway.process is not None
    started = time.monotonic()
    gateway.stop()  # the launcher's own timeout: the service's grace plus a margin
    elapsed = time.monotonic() - started
    record_property("stop_s", round(elapsed, 3))
    # The gateway drained for its whole grace (the stream outlived it and was cut), flushed and
    # exited by itself: not a SIGKILL (-9) at a fixed 15 s.
    assert gateway.process.returncode == 0, (gateway.process.returncode, elapsed, gateway.log_tail())
    assert GRACE_S <= elapsed < GRACE_S + STOP_MARGIN_S, elapsed
    assert stream.ended.wait(30)


def test_a_second_sigterm_cuts_the_http_front_drain(
    held_gateway: tuple[ServiceProcess, HeldStream], record_property: Callable[[str, object], None]
) -> None:
    gateway, stream = held_gateway
    assert gateway.process is not None
    gateway.terminate()
    wait_for(lambda: '"shutting_down"' in gateway.log_tail(), "the gateway to start draining", timeout_s=30)
    time.sleep(1.0)  # past the NOT_SERVING notice: the HTTP front is draining its open stream
    assert gateway.process.poll() is None and not stream.ended.is_set()
    second = time.monotonic()
    gateway.terminate()
    # The stream is cut and the process exits at once, well before the grace would end (a drain
    # left to run would wait on the frozen adapter until GRACE_S or the channel's keepalive).
    gateway.process.wait(GRACE_S / 2)
    record_property("exit_after_second_sigterm_s", round(time.monotonic() - second, 3))
    assert time.monotonic() - second < GRACE_S / 2
    assert '"shutting_down_now"' in gateway.log_tail(60)
    assert stream.ended.wait(10)


def test_keeper_restarts_leak_no_file(tmp_path: Path) -> None:
    """20 crashes and restarts of rate-limit by the keeper: the launcher's open descriptors are
    what they were, and none was left for the garbage collector to close."""
    service = ServiceProcess(
        "rate-limit",
        "sluice_rate_limit",
        {"SLUICE_RATELIMIT_PORT": "0", "SLUICE_RATELIMIT_METRICS_PORT": "0",
         "SLUICE_RATELIMIT_LIMITS_FILE": str(REPO_ROOT / "config" / "limits.toml")},
        tmp_path / "rate-limit.log",
        port_env=RATELIMIT_PORT_ENV,
    )  # fmt: skip
    keeper = ServiceKeeper([service], say=lambda _: None, first_backoff_s=0, max_backoff_s=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        service.start_ready(60)  # counted from here: what a health check opens for good (gRPC's own) is open by now
        port = service.ports["grpc"]
        gc.collect()
        before = sorted(os.listdir("/proc/self/fd"))
        for _ in range(20):
            service.kill()
            keeper.poll()  # reports the exit
            keeper.poll()  # starts it again
        assert keeper.restarted["rate-limit"] == 20
        service.wait_ready(60)
        assert service.ports["grpc"] == port  # a restart binds the port it reported first
        gc.collect()
        after = sorted(os.listdir("/proc/self/fd"))
    service.kill()
    assert len(after) == len(before), (before, after)
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert not unclosed, unclosed


def test_stack_services_report_the_ports_they_bound(stack: Stack) -> None:
    """The session stack binds port 0 everywhere (StackPorts.ephemeral): each address it gives is
    one the service reported, and serves."""
    gateway = stack.service("gateway")
    assert set(gateway.ports) == {"grpc", "metrics", "http"}
    assert gateway.env["SLUICE_GATEWAY_HTTP_PORT"] == str(gateway.ports["http"])  # pinned for a restart
    # test_jobs replaces the stack's own job worker (a killed-worker test): any live one will do.
    worker = next(s for s in stack.services if s.name.startswith("job-worker") and s.process is not None and s.process.poll() is None)
    metrics = [stack.metrics_url(name) for name in ("gateway", "inference-adapter", "rate-limit", "evaluation-logging")]
    for url in [*metrics, f"http://127.0.0.1:{worker.ports['metrics']}/metrics"]:
        with urllib.request.urlopen(url, timeout=5) as reply:
            assert reply.status == 200
    models = urllib.request.Request(f"{stack.openai_base_url}/models", headers={"Authorization": f"Bearer {DEMO_KEY}"})
    with urllib.request.urlopen(models, timeout=5) as reply:
        assert reply.status == 200


class _StartedTriton(Exception):
    """Stops a stack's start once triton-local is ready: the rest is not what the test is about."""


def test_a_triton_port_taken_after_its_probe_starts_triton_local_on_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tritonserver binds what it is told, so the launcher probes its ports free; when another
    process takes one between the probe and the bind, tritonserver exits, triton-local exits with
    it at once (not after PyTriton's minute-long readiness wait) and is started again on new ports.
    A tritonserver that dies later takes triton-local down too, rather than leaving it up serving
    nothing."""
    taker = socket.socket()
    taker.bind(("0.0.0.0", 0))
    taker.listen()
    taken = taker.getsockname()[1]
    first_ports = iter([taken])  # the first probe's first port (Triton's HTTP port) is one already held
    real_free_ports = launcher.free_ports

    def probe(count: int) -> list[int]:
        ports = real_free_ports(count)
        ports[0] = next(first_ports, ports[0])
        return ports

    monkeypatch.setattr(launcher, "free_ports", probe)
    stack = Stack(tmp_path, ports=StackPorts.ephemeral(), serve_variant=False)
    assert stack.ports.triton_http == taken
    started: list[ServiceProcess] = []
    exit_codes: list[int | None] = []

    def kill_tritonserver_then_stop(service: ServiceProcess) -> None:
        started.append(service)
        assert service.process is not None
        (tritonserver,) = _children_named(service.process.pid, "tritonserver")
        os.kill(tritonserver, signal.SIGKILL)
        try:
            exit_codes.append(service.process.wait(timeout=20))
        except subprocess.TimeoutExpired:
            exit_codes.append(None)
        raise _StartedTriton

    try:
        with pytest.raises(_StartedTriton):
            stack.start(timeout_s=240, on_ready=kill_tritonserver_then_stop)
    finally:
        taker.close()
    assert [s.name for s in started] == ["triton-local"]
    moved = stack.triton_ports["triton-local"]
    assert moved.http not in (0, taken) and stack.ports.triton_http == moved.http
    assert started[0].env["SLUICE_TRITON_LOCAL_HTTP_PORT"] == str(moved.http)
    triton_log = (tmp_path / "triton-local.tritonserver.log").read_text(errors="replace")
    assert f":{taken}' already in use" in triton_log, triton_log[-2000:]
    service_log = (tmp_path / "triton-local.log").read_text(errors="replace")
    assert service_log.count("tritonserver_exited") == 2, service_log[-3000:]  # the taken port, then the kill
    assert exit_codes == [1], service_log[-3000:]


def _children_named(pid: int, name: str) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid), "-x", name], capture_output=True, text=True, check=False)
    return [int(line) for line in found.stdout.split()]


def test_a_service_with_a_ready_event_is_ready_only_once_it_logged_it(tmp_path: Path) -> None:
    """triton-local's Triton answers ready after its first model's load, before the others': the
    launcher also waits for the "ready" line triton-local logs once every model is in (a stack that
    went on earlier sent a test's requests to a replica whose probes then failed)."""
    log = tmp_path / "triton-local.log"
    service = ServiceProcess("triton-local", "sluice_triton_local", {}, log, ready=lambda: True, ready_event=launcher.TRITON_LOCAL_READY)
    log.write_text(json.dumps({"event": "model_loaded"}) + "\nnot json\n")
    assert not service.is_ready()
    with log.open("a") as out:
        out.write(json.dumps({"event": "ready", "models": ["smollm2_step"]}) + "\n")
    assert service.is_ready()
    assert not ServiceProcess("other", "sluice_triton_local", {}, log, ready=lambda: False, ready_event="ready").is_ready()


def test_probed_ports_picked_together_are_all_different() -> None:
    """A port released is often handed out again at once: one replica got the same HTTP and metrics
    port (tritonserver refuses to start so) while each was probed and released in turn."""
    ports = launcher.free_ports(64)
    assert len(set(ports)) == 64


def test_every_gateway_spills_to_files_of_its_own(stack: Stack) -> None:
    """With port 0 every gateway spilled SubmitJob's jobs to <temp>/sluice-gateway-0-jobs.spill: one
    file for all of them (and other stacks'), which a restarted gateway, now on its bound port, never
    read back."""
    specs = [stack._gateway_spec(name) for name in ("gateway", "gateway-2")]
    for kind in ("JOBS", "EVENTS"):
        files = [env[f"SLUICE_GATEWAY_{kind}_SPILL_FILE"] for _name, _module, env, _port_env in specs]
        assert len(set(files)) == 2 and all(f.startswith(str(stack.run_dir)) for f in files), files


# A launcher of the test's own (a process the test can SIGKILL): triton-local (the main model alone)
# and two rate-limits, started in one wave, so from the pool threads that Stack.start uses, as `make
# run` starts its services. triton-local and "rate-limit" run as the launcher runs every service;
# "rate-limit-by-hand" as `python -m MODULE`, tied by the service's own bootstrap alone (run_service).
DYING_LAUNCHER = """
import json, sys, time
from pathlib import Path
from sluice_stack.launcher import RATELIMIT_PORT_ENV, REPO_ROOT, ServiceProcess, Stack, StackPorts

class ByHand(ServiceProcess):
    def command(self):
        return [str(self.python), "-m", self.module]

class Dying(Stack):
    def _plan(self):
        def rate_limit(cls, name):
            env = {"SLUICE_RATELIMIT_PORT": "0", "SLUICE_RATELIMIT_METRICS_PORT": "0",
                   "SLUICE_RATELIMIT_LIMITS_FILE": str(REPO_ROOT / "config" / "limits.toml")}
            return lambda: cls(name, "sluice_rate_limit", env, self.run_dir / f"{name}.log", project="rate-limit", port_env=RATELIMIT_PORT_ENV)
        return [[lambda: self._triton_service("triton-local"), rate_limit(ServiceProcess, "rate-limit"), rate_limit(ByHand, "rate-limit-by-hand")]]

stack = Dying(Path(sys.argv[1]), ports=StackPorts.ephemeral(), serve_variant=False)
stack.start(timeout_s=120)
(stack.run_dir / "pids.json").write_text(json.dumps({s.name: s.process.pid for s in stack.services}))
time.sleep(600)
"""


def _group(pgid: int) -> list[int]:
    """The processes of process group `pgid` that run (a zombie, exited but not yet reaped by its new
    parent, does not): a service started by the launcher leads one, with what it started."""
    members = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, group = stat_file.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(group) == pgid and state not in ("Z", "X"):
            members.append(int(stat_file.parent.name))
    return members


def test_services_die_with_a_launcher_killed_without_its_cleanup(tmp_path: Path, record_property: Callable[[str, object], None]) -> None:
    """A launcher that dies without stopping its services (SIGKILL, a CI timeout's kill) takes them
    with it: each sees its lifeline close, drains and exits, with what it started (tritonserver),
    instead of keeping its ports and the model for the next `make run` to trip on."""
    launcher_process = subprocess.Popen(
        [sys.executable, "-c", DYING_LAUNCHER, str(tmp_path)], env={**os.environ, "SLUICE_SHUTDOWN_GRACE_S": "5"}, start_new_session=True
    )
    pids_file = tmp_path / "pids.json"
    pids: dict[str, int] = {}
    try:
        wait_for(lambda: pids_file.exists() or launcher_process.poll() is not None, "the launcher to start its services", timeout_s=150)
        assert launcher_process.poll() is None, "the launcher failed to start its services"
        pids = json.loads(pids_file.read_text())
        assert set(pids) == {"triton-local", "rate-limit", "rate-limit-by-hand"}
        assert len(_group(pids["triton-local"])) > 1 and all(_group(pid) for pid in pids.values())  # tritonserver too
        os.kill(launcher_process.pid, signal.SIGKILL)
        launcher_process.wait(10)
        killed = time.monotonic()
        wait_for(lambda: not any(_group(pid) for pid in pids.values()), "the services to exit after their launcher", timeout_s=30)
        record_property("services_gone_after_s", round(time.monotonic() - killed, 3))
        for name in pids:
            log = (tmp_path / f"{name}.log").read_text(errors="replace")
            assert '"lifeline_closed"' in log and '"stopped"' in log, log[-2000:]  # a drain, not the bound's SIGKILL
    finally:
        if launcher_process.poll() is None:
            os.kill(launcher_process.pid, signal.SIGKILL)
            launcher_process.wait()
        for pid in pids.values():
            if _group(pid):
                os.killpg(pid, signal.SIGKILL)


def test_a_second_ctrl_c_during_the_stop_still_stops_every_tier(tmp_path: Path) -> None:
    """Ctrl-C while the stack stops (the gateways draining) left the adapters, rate-limit and
    triton-local never signalled: now it cuts the drains under way (a second SIGTERM to the
    services being stopped) and the stop goes on through every tier before the KeyboardInterrupt."""
    signals: list[str] = []

    class Process:
        """What ServiceProcess.stop asks of its process, recorded; the gateway's drain is interrupted."""

        def __init__(self, name: str) -> None:
            self.name, self.returncode = name, None

        def poll(self) -> int | None:
            return self.returncode

        def send_signal(self, sig: int) -> None:
            signals.append(f"{signal.Signals(sig).name} {self.name}")

        def wait(self, timeout: float | None = None) -> int:
            if self.name == "gateway":
                os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C, during the gateway's drain
            self.returncode = 0
            return 0

    stack = Stack(tmp_path, ports=StackPorts.ephemeral())
    modules = {"triton-local": "sluice_triton_local", "rate-limit": "sluice_rate_limit", "inference-adapter": "sluice_inference_adapter"}
    for name, module in {**modules, "gateway": "sluice_gateway"}.items():
        stack.services.append(ServiceProcess(name, module, {}, tmp_path / f"{name}.log", process=Process(name)))  # type: ignore[arg-type]
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own (a background job's is SIG_IGN)
    try:
        with pytest.raises(KeyboardInterrupt):
            stack.stop()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert signals[:2] == ["SIGTERM gateway", "SIGTERM gateway"], signals
    assert sorted(signals[2:4]) == ["SIGTERM inference-adapter", "SIGTERM rate-limit"] and signals[4:] == ["SIGTERM triton-local"], signals
    assert not stack.services
