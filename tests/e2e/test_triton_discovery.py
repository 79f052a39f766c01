"""Triton pods behind one DNS name (issue 13): the adapter is given `dns:///<name>:<port>` and finds
a real triton-local at each address the name resolves to.

A name with two addresses, without touching the machine's /etc/hosts: the adapter runs in a
private mount namespace (`unshare -m`) where a hosts file of the test's own is bind-mounted over
/etc/hosts, so the system resolver (glibc, through asyncio's getaddrinfo) answers both
127.0.0.1 and 127.0.0.2 for the name. Each address has its own triton-local, both on the same
gRPC port (SLUICE_TRITON_LOCAL_HOST binds one to 127.0.0.2). Rewriting that file in place (the
bind mount follows the inode) is a pod leaving or joining the headless Service. Skipped where a
mount namespace cannot be made (not root, no CAP_SYS_ADMIN).
"""

from __future__ import annotations

import subprocess
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from sluice.common.v1 import types_pb2
from sluice.inference.v1 import inference_pb2, inference_pb2_grpc

from conftest import MODEL, scrape, wait_for
from sluice_stack import ServiceProcess, free_ports
from sluice_stack.launcher import ADAPTER_PORT_ENV, SERVICE_RUNNER, TRITON_LOCAL_READY, http_ok

NAME = "sluice-triton-pods"
POD_IPS = ("127.0.0.1", "127.0.0.2")
# One engine thread each: two llama.cpp processes with a thread per core spin against each other.
TRITON_ENV = {"SLUICE_TRITON_LOCAL_THREADS": "1", "SLUICE_TRITON_LOCAL_MAX_SLOTS": "8"}
TOKENS = 48


@dataclass
class NamespacedService(ServiceProcess):
    """A service whose /etc/hosts is `hosts_file`, in a mount namespace of its own."""

    hosts_file: Path = Path("/dev/null")

    def command(self) -> list[str]:
        # unshare and sh exec into python: the pid (and its process group) is the service's; run as
        # the launcher runs every service (SERVICE_RUNNER), so that it dies with this test's process.
        return ["unshare", "-m", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$1" -m "$2" "$3"', str(self.hosts_file), str(self.python), SERVICE_RUNNER, self.module]  # fmt: skip


@dataclass
class Pods:
    grpc_port: int
    hosts_file: Path
    tritons: dict[str, ServiceProcess]
    model_metrics: dict[str, str]
    adapter: ServiceProcess
    adapter_address: str
    adapter_metrics: str

    def replica(self, ip: str) -> str:
        return f"{ip}:{self.grpc_port}"

    def publish(self, *ips: str) -> None:
        """What the name resolves to from now on (in place: the bind mount follows the inode)."""
        with self.hosts_file.open("r+") as hosts:
            hosts.truncate(0)
            hosts.write(hosts_text(ips))


def hosts_text(ips: tuple[str, ...]) -> str:
    return "127.0.0.1 localhost\n" + "".join(f"{ip} {NAME}\n" for ip in ips)


def namespaces_work(hosts_file: Path) -> bool:
    try:
        found = subprocess.run(
            ["unshare", "-m", "sh", "-c", 'mount --bind "$0" /etc/hosts && getent ahosts "$1"', str(hosts_file), NAME],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return False
    return found.returncode == 0 and all(ip in found.stdout for ip in POD_IPS)


@pytest.fixture(scope="module")
def pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pods]:
    run_dir = tmp_path_factory.mktemp("discovery")
    hosts_file = run_dir / "hosts"
    hosts_file.write_text(hosts_text(POD_IPS))
    if not namespaces_work(hosts_file):
        pytest.skip("no private mount namespace here (unshare -m and a bind mount need CAP_SYS_ADMIN)")
    # Triton's ports are probed: tritonserver binds what it is told and cannot say what it bound.
    grpc_port, *pod_ports = free_ports(1 + 3 * len(POD_IPS))
    tritons: dict[str, ServiceProcess] = {}
    model_metrics: dict[str, str] = {}
    started: list[ServiceProcess] = []
    try:
        for index, ip in enumerate(POD_IPS):
            http, triton_metrics, metrics = pod_ports[3 * index : 3 * index + 3]
            env = {
                "PYTHONUNBUFFERED": "1",
                **TRITON_ENV,
                "SLUICE_TRITON_LOCAL_HOST": ip,
                "SLUICE_TRITON_LOCAL_GRPC_PORT": str(grpc_port),
                "SLUICE_TRITON_LOCAL_HTTP_PORT": str(http),
                "SLUICE_TRITON_LOCAL_TRITON_METRICS_PORT": str(triton_metrics),
                "SLUICE_TRITON_LOCAL_METRICS_PORT": str(metrics),
                "SLUICE_TRITON_LOCAL_TRITON_LOG_FILE": str(run_dir / f"pod-{index}.tritonserver.log"),
            }
            pod = ServiceProcess(f"pod-{index}", "sluice_triton_local", env, run_dir / f"pod-{index}.log",
                                 http_ok(f"http://{ip}:{http}/v2/health/ready"), project="triton-local", ready_event=TRITON_LOCAL_READY)  # fmt: skip
            tritons[ip] = pod
            model_metrics[ip] = f"http://{ip}:{metrics}/metrics"
            pod.start()  # both load their models at once
            started.append(pod)
        for pod in tritons.values():
            pod.wait_ready(300)
        adapter_env = {
            "PYTHONUNBUFFERED": "1",
            "SLUICE_ADAPTER_PORT": "0",
            "SLUICE_ADAPTER_METRICS_PORT": "0",
            "SLUICE_ADAPTER_TRITON_URLS": f"dns:///{NAME}:{grpc_port}",
            "SLUICE_ADAPTER_TRITON_RESOLVE_INTERVAL_S": "0.5",
            "SLUICE_ADAPTER_PROBE_INTERVAL_S": "0.5",
            "SLUICE_ADAPTER_MAX_BATCH_SIZE": "8",
        }
        adapter = NamespacedService("inference-adapter", "sluice_inference_adapter", adapter_env, run_dir / "inference-adapter.log",
                                    port_env=ADAPTER_PORT_ENV, hosts_file=hosts_file)  # fmt: skip
        started.append(adapter)
        adapter.start_ready(300)
        metrics_url = f"http://127.0.0.1:{adapter.ports['metrics']}/metrics"
        yield Pods(grpc_port, hosts_file, tritons, model_metrics, adapter, adapter.address, metrics_url)
    finally:
        for service in reversed(started):
            service.stop()


def question(index: int, max_tokens: int = TOKENS) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        request_id=f"discovery-{index}",
        tenant="demo",
        model=MODEL,
        messages=[types_pb2.ChatMessage(role="user", content=f"Name {index + 2} animals that live in the sea.")],
        sampling=types_pb2.SamplingParams(max_tokens=max_tokens),
    )


def generate(address: str, request: inference_pb2.GenerateRequest, streamed: list[str] | None = None) -> str:
    """The whole text (raises grpc.RpcError); `streamed` collects the text as it arrives."""
    text = ""
    with grpc.insecure_channel(address) as channel:
        for response in inference_pb2_grpc.InferenceServiceStub(channel).Generate(request, timeout=240):
            text += response.text
            if streamed is not None:
                streamed.append(response.text)
    return text


def concurrently(address: str, indices: list[int], streamed: dict[int, list[str]] | None = None) -> tuple[dict[int, str], list[threading.Thread]]:
    """Starts one stream per index; results fill in as they end (text, or "CODE: details")."""
    results: dict[int, str] = {}

    def run(index: int) -> None:
        try:
            results[index] = generate(address, question(index), None if streamed is None else streamed.setdefault(index, []))
        except grpc.RpcError as error:
            results[index] = f"{error.code().name}: {error.details()}"

    threads = [threading.Thread(target=run, args=(i,)) for i in indices]
    for thread in threads:
        thread.start()
    return results, threads


def join(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join(timeout=300)


def series(url: str, name: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return "\n".join(line for line in reply.read().decode().splitlines() if line.startswith(name))


def logged(pods: Pods, event: str, replica: str) -> bool:
    """The adapter logged `event` about `replica` (one JSON line each)."""
    lines = pods.adapter.log_path.read_text().splitlines()
    return any(f'"event": "{event}"' in line and f'"replica": "{replica}"' in line for line in lines)


SOLO: dict[int, str] = {}


def solo(pods: Pods, indices: list[int]) -> dict[int, str]:
    """Each question's text when it runs alone (greedy decoding: any batch must give the same)."""
    for index in indices:
        if index not in SOLO:
            SOLO[index] = generate(pods.adapter_address, question(index))
    return {i: SOLO[i] for i in indices}


def test_both_addresses_serve_with_per_replica_metrics_and_streams_equal_their_solo_text(pods: Pods) -> None:
    metrics = pods.adapter_metrics
    wait_for(lambda: scrape(metrics, "sluice_adapter_replicas", '{state="serving"}') == 2, "both pods to be serving", timeout_s=30)
    expected = solo(pods, list(range(8)))
    results, threads = concurrently(pods.adapter_address, list(range(8)))
    join(threads)
    assert results == expected
    for ip in POD_IPS:
        replica = f'{{replica="{pods.replica(ip)}"}}'
        # Both pods took work, and the adapter says so per replica.
        assert scrape(metrics, "sluice_adapter_step_seconds_count", replica) > 0, series(metrics, "sluice_adapter_step_seconds_count")
        assert scrape(metrics, "sluice_adapter_replica_healthy", replica) == 1
        assert scrape(pods.model_metrics[ip], "sluice_triton_local_tokens_generated_total") > 0


def test_an_address_that_leaves_the_name_is_drained_its_streams_finish_and_it_comes_back(pods: Pods) -> None:
    metrics = pods.adapter_metrics
    leaving, staying = pods.replica(POD_IPS[1]), pods.replica(POD_IPS[0])
    indices = list(range(20, 28))
    expected = solo(pods, indices)
    results, threads = concurrently(pods.adapter_address, indices)
    wait_for(lambda: scrape(metrics, "sluice_adapter_kv_slots_in_use", f'{{replica="{leaving}"}}') > 0,
             "the leaving pod to run sequences", timeout_s=60, poll_s=0.05)  # fmt: skip
    pods.publish(POD_IPS[0])
    wait_for(lambda: scrape(metrics, "sluice_adapter_replicas", '{state="draining"}') == 1, "the pod to be drained", timeout_s=10)
    join(threads)
    # Its sequences finished there, whole: every stream equals its solo text.
    assert results == expected
    wait_for(lambda: scrape(metrics, "sluice_adapter_replicas", '{state="draining"}') == 0, "the drained pod to be removed", timeout_s=10)
    assert scrape(metrics, "sluice_adapter_replicas", '{state="serving"}') == 1
    assert f'replica="{leaving}"' not in series(metrics, "sluice_adapter_replica_healthy")
    # Once removed, it gets nothing (its pod still runs: only the name stopped naming it).
    after_removal = scrape(pods.model_metrics[POD_IPS[1]], "sluice_triton_local_tokens_generated_total")
    assert generate(pods.adapter_address, question(20)) == expected[20]
    assert scrape(pods.model_metrics[POD_IPS[1]], "sluice_triton_local_tokens_generated_total") == after_removal
    assert logged(pods, "replica_draining", leaving) and logged(pods, "replica_removed", leaving)
    # The address comes back: a new replica, probed, then serving.
    pods.publish(*POD_IPS)
    wait_for(lambda: scrape(metrics, "sluice_adapter_replicas", '{state="serving"}') == 2, "the pod to be added again", timeout_s=15)
    assert logged(pods, "replica_added", leaving)
    assert scrape(metrics, "sluice_adapter_replica_healthy", f'{{replica="{staying}"}}') == 1


def test_killing_one_pod_mid_load_fails_no_sequence_that_had_not_started_on_it(pods: Pods) -> None:
    metrics = pods.adapter_metrics
    wait_for(lambda: scrape(metrics, "sluice_adapter_replicas", '{state="serving"}') == 2, "both pods to be serving", timeout_s=30)
    victim = POD_IPS[1]
    indices = list(range(40, 52))
    expected = solo(pods, indices)
    streamed: dict[int, list[str]] = {}
    moved_before = scrape(metrics, "sluice_adapter_retries_total")
    results, threads = concurrently(pods.adapter_address, indices, streamed)
    wait_for(lambda: scrape(metrics, "sluice_adapter_kv_slots_in_use", f'{{replica="{pods.replica(victim)}"}}') > 0,
             "the victim pod to run sequences", timeout_s=60, poll_s=0.05)  # fmt: skip
    pods.tritons[victim].kill()
    join(threads)
    assert len(results) == len(indices)
    failed = {i: r for i, r in results.items() if r != expected[i]}
    for index, result in failed.items():
        # Only a sequence that had already streamed from the killed pod may fail, and not silently.
        assert "".join(streamed.get(index, [])) and result.startswith("UNAVAILABLE"), (index, result)
    assert len(failed) < len(indices)
    # The kill hit work in flight: sequences without a token yet were moved to the other pod.
    assert scrape(metrics, "sluice_adapter_retries_total") - moved_before + len(failed) > 0
    # Every sequence on the surviving pod, or moved there before its first token, ended whole.
    wait_for(lambda: scrape(metrics, "sluice_adapter_replica_healthy", f'{{replica="{pods.replica(victim)}"}}') == 0,
             "the killed pod to be unhealthy", timeout_s=20)  # fmt: skip
    after, threads = concurrently(pods.adapter_address, indices[:4])
    join(threads)
    assert after == {i: expected[i] for i in indices[:4]}
