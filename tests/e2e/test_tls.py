"""Mutual TLS between the services and TLS for clients, with certificates made here by trustme.

First the bootstrap alone (sluice-common's server and channels), then the real stack started
with mutual TLS on the gateway and the adapter: a client without a valid certificate is refused,
one with it is served, and the gateway reaches the adapter only with its own certificate.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from conftest import MODEL, auth
from sluice_common.channels import open_channel
from sluice_common.config import ClientTLS, ConfigError, ServerConfig, ServerTLS, load_config
from sluice_common.server import create_server
from sluice_stack import Stack, StackPorts

SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Our CA with certificates for every service and a client; and a stranger CA's client."""
    folder = tmp_path_factory.mktemp("pki")
    ca, stranger = trustme.CA(), trustme.CA()
    files: dict[str, str] = {}

    def issue(name: str, authority: trustme.CA, *identities: str) -> None:
        cert = authority.issue_cert(*identities)
        files[f"{name}_cert"] = str(folder / f"{name}.crt")
        files[f"{name}_key"] = str(folder / f"{name}.key")
        Path(files[f"{name}_cert"]).write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
        cert.private_key_pem.write_to_path(files[f"{name}_key"])

    files["ca"] = str(folder / "ca.crt")
    ca.cert_pem.write_to_path(files["ca"])
    # Services are dialled as 127.0.0.1 here, as <service>.<namespace>.svc in Kubernetes.
    issue("adapter", ca, "127.0.0.1", "localhost", "inference-adapter.sluice.svc")
    issue("gateway", ca, "127.0.0.1", "localhost", "gateway.sluice.svc")
    issue("ratelimit", ca, "127.0.0.1", "localhost", "rate-limit.sluice.svc")
    issue("evallog", ca, "127.0.0.1", "localhost", "evaluation-logging.sluice.svc")
    issue("client", ca, "client.example")
    issue("rogue", stranger, "client.example")
    return files


# ---- the bootstrap alone -------------------------------------------------------------------


def _health(channel: grpc.aio.Channel) -> asyncio.Future:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)


async def _status_or_code(target: str, tls: ClientTLS | None) -> object:
    async with open_channel(target, tls) as channel:
        try:
            return (await _health(channel)).status
        except grpc.aio.AioRpcError as exc:
            return exc.code()


def test_bootstrap_mutual_tls_serves_a_client_with_a_certificate_and_refuses_others(pki) -> None:
    async def scenario() -> list[object]:
        running = await create_server("127.0.0.1", 0, -1, lambda server: [], tls=ServerTLS(pki["adapter_cert"], pki["adapter_key"], pki["ca"]))
        target = f"127.0.0.1:{running.port}"
        try:
            return [
                await _status_or_code(target, ClientTLS(pki["ca"], pki["gateway_cert"], pki["gateway_key"])),
                await _status_or_code(target, ClientTLS(pki["ca"])),  # no client certificate
                await _status_or_code(target, ClientTLS(pki["ca"], pki["rogue_cert"], pki["rogue_key"])),
                await _status_or_code(target, None),  # plaintext
            ]
        finally:
            await running.shutdown(0)

    served, without_cert, rogue, plaintext = asyncio.run(scenario())
    assert served == SERVING
    assert without_cert == rogue == plaintext == grpc.StatusCode.UNAVAILABLE


def test_bootstrap_server_tls_and_server_name_override(pki) -> None:
    async def scenario() -> list[object]:
        running = await create_server("127.0.0.1", 0, -1, lambda server: [], tls=ServerTLS(pki["adapter_cert"], pki["adapter_key"]))
        try:
            return [
                await _status_or_code(f"localhost:{running.port}", ClientTLS(pki["ca"])),
                # Dialled by an address the certificate does not carry, checked against a name it does.
                await _status_or_code(f"127.0.0.1:{running.port}", ClientTLS(pki["ca"], server_name="inference-adapter.sluice.svc")),
                await _status_or_code(f"127.0.0.1:{running.port}", ClientTLS(pki["ca"], server_name="elsewhere.example")),
            ]
        finally:
            await running.shutdown(0)

    by_name, overridden, wrong_name = asyncio.run(scenario())
    assert by_name == overridden == SERVING
    assert wrong_name == grpc.StatusCode.UNAVAILABLE


def test_bootstrap_serves_renewed_certificate_files_without_a_restart(pki, tmp_path: Path) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(Path(pki["rogue_cert"]).read_bytes())  # first a certificate our CA did not sign
    key.write_bytes(Path(pki["rogue_key"]).read_bytes())

    async def scenario() -> list[object]:
        running = await create_server("127.0.0.1", 0, -1, lambda server: [], tls=ServerTLS(str(cert), str(key)))
        target = f"127.0.0.1:{running.port}"
        try:
            before = await _status_or_code(target, ClientTLS(pki["ca"]))
            cert.write_bytes(Path(pki["adapter_cert"]).read_bytes())
            key.write_bytes(Path(pki["adapter_key"]).read_bytes())
            return [before, await _status_or_code(target, ClientTLS(pki["ca"]))]
        finally:
            await running.shutdown(0)

    before, after = asyncio.run(scenario())
    assert before == grpc.StatusCode.UNAVAILABLE and after == SERVING


def test_tls_settings_are_off_by_default_and_checked_when_set(pki) -> None:
    assert load_config(ServerConfig, "EX_", environ={}).server_tls("EX_") is None
    environ = {"EX_TLS_CERT_FILE": pki["adapter_cert"], "EX_TLS_KEY_FILE": pki["adapter_key"], "EX_TLS_CLIENT_CA_FILE": pki["ca"]}
    assert load_config(ServerConfig, "EX_", environ=environ).server_tls("EX_") == ServerTLS(pki["adapter_cert"], pki["adapter_key"], pki["ca"])
    with pytest.raises(ConfigError, match="EX_TLS_KEY_FILE must be set"):
        load_config(ServerConfig, "EX_", environ={"EX_TLS_CERT_FILE": pki["adapter_cert"]}).server_tls("EX_")
    with pytest.raises(ConfigError, match="EX_TLS_CLIENT_CA_FILE=/nope is not a readable file"):
        ServerTLS.from_settings(pki["adapter_cert"], pki["adapter_key"], "/nope", "EX_TLS_")
    assert ClientTLS.from_settings("", "", "") is None
    assert ClientTLS.from_settings("", "", "", enabled=True) == ClientTLS(enabled=True)
    with pytest.raises(ConfigError, match="X_CERT_FILE and X_KEY_FILE go together"):
        ClientTLS.from_settings(pki["ca"], pki["client_cert"], "", env_prefix="X_")


# ---- the real stack with mutual TLS ---------------------------------------------------------


def _credentials(pki: dict[str, str], who: str | None) -> grpc.ChannelCredentials:
    read = lambda name: Path(pki[name]).read_bytes()  # noqa: E731
    if who is None:
        return grpc.ssl_channel_credentials(root_certificates=read("ca"))
    return grpc.ssl_channel_credentials(read("ca"), read(f"{who}_key"), read(f"{who}_cert"))


@pytest.fixture(scope="module")
def tls_stack(pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    run_dir = Path(os.environ.get("SLUICE_TEST_RUN_DIR", tmp_path_factory.mktemp("stack"))) / "tls"
    mutual = lambda who: {  # noqa: E731
        "TLS_CERT_FILE": pki[f"{who}_cert"],
        "TLS_KEY_FILE": pki[f"{who}_key"],
        "TLS_CLIENT_CA_FILE": pki["ca"],
    }
    # Every hop is mutual TLS. The gateway and its job-worker role dial the adapter and
    # rate-limit with the gateway's identity; evaluation-logging dials the adapter with its own.
    dial = lambda prefix, peer, who: {  # noqa: E731
        f"{prefix}{peer}_TLS_CA_FILE": pki["ca"],
        f"{prefix}{peer}_TLS_CERT_FILE": pki[f"{who}_cert"],
        f"{prefix}{peer}_TLS_KEY_FILE": pki[f"{who}_key"],
    }
    adapter_client = {**dial("SLUICE_GATEWAY_", "ADAPTER", "gateway"), **dial("SLUICE_GATEWAY_", "RATELIMIT", "gateway")}
    stack = Stack(
        run_dir=run_dir,
        ports=StackPorts.ephemeral(),
        serve_variant=False,  # sluice eval's second model is test_eval's subject, not this module's
        extra_env={
            "inference-adapter": {f"SLUICE_ADAPTER_{k}": v for k, v in mutual("adapter").items()},
            "rate-limit": {f"SLUICE_RATELIMIT_{k}": v for k, v in mutual("ratelimit").items()},
            "evaluation-logging": {
                **{f"SLUICE_EVALLOG_{k}": v for k, v in mutual("evallog").items()},
                **dial("SLUICE_EVALLOG_", "ADAPTER", "evallog"),
            },
            "gateway": {**{f"SLUICE_GATEWAY_{k}": v for k, v in mutual("gateway").items()}, **adapter_client},
            "job-worker": adapter_client,
        },
        grpc_credentials=_credentials(pki, "client"),
    )
    stack.start(timeout_s=300)
    yield stack
    stack.stop()


def _generate(address: str, credentials: grpc.ChannelCredentials | None) -> str:
    channel = grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)
    request = gateway_pb2.GenerateRequest(
        model=MODEL,
        messages=[types_pb2.ChatMessage(role="user", content="Which city is the capital of France?")],
        sampling=types_pb2.SamplingParams(max_tokens=16),
    )
    with channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        return "".join(r.text for r in stub.Generate(request, metadata=auth(), timeout=120))


def test_client_with_a_valid_certificate_is_served(tls_stack, pki) -> None:
    assert "Paris" in _generate(tls_stack.gateway_address, _credentials(pki, "client"))


@pytest.mark.parametrize("client", ["no certificate", "certificate from another CA", "plaintext"])
def test_client_without_a_valid_certificate_is_refused(tls_stack, pki, client) -> None:
    credentials = {
        "no certificate": _credentials(pki, None),
        "certificate from another CA": _credentials(pki, "rogue"),
        "plaintext": None,
    }[client]
    with pytest.raises(grpc.RpcError) as caught:
        _generate(tls_stack.gateway_address, credentials)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("service", ["adapter", "ratelimit", "evallog"])
def test_internal_services_accept_only_clients_with_a_certificate(tls_stack, pki, service) -> None:
    """The gateway got through to the adapter and rate-limit (it served above) with its certificate;
    nothing gets into any internal service without one."""
    address = getattr(tls_stack, f"{service}_address")
    for credentials, expected in ((_credentials(pki, "gateway"), True), (_credentials(pki, None), False)):
        with grpc.secure_channel(address, credentials) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                served = reply.status == SERVING
            except grpc.RpcError:
                served = False
        assert served is expected


def test_container_healthcheck_speaks_the_service_tls(tls_stack, pki) -> None:
    """`python -m sluice_common.healthcheck` (the image HEALTHCHECK, the exec probe under TLS)."""
    import subprocess

    from sluice_stack import REPO_ROOT

    python = str(REPO_ROOT / "services" / "gateway" / ".venv" / "bin" / "python")
    base = {"PATH": os.environ.get("PATH", ""), "SLUICE_GATEWAY_PORT": tls_stack.gateway_address.rsplit(":", 1)[1]}
    own = {
        "SLUICE_GATEWAY_TLS_CERT_FILE": pki["gateway_cert"],
        "SLUICE_GATEWAY_TLS_KEY_FILE": pki["gateway_key"],
        "SLUICE_GATEWAY_TLS_CLIENT_CA_FILE": pki["ca"],
    }
    probe = lambda env: subprocess.run(  # noqa: E731
        [python, "-m", "sluice_common.healthcheck", "SLUICE_GATEWAY_", "50051"], env=env, capture_output=True, timeout=30
    )
    assert probe({**base, **own}).returncode == 0
    assert probe(base).returncode == 1  # plaintext against a TLS port
