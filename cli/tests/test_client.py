"""client.py: the Bearer metadata every command sends, and channels that reach a real gRPC server,
plaintext or over TLS when SLUICE_TLS_* say so."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import trustme
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from sluice_cli import client
from sluice_cli.main import _grpc_health, build_parser, cmd_logs, cmd_models
from sluice_common.config import ConfigError


def test_the_key_travels_as_bearer_metadata() -> None:
    assert client.bearer_metadata("sk-1") == (("authorization", "Bearer sk-1"),)


def test_a_missing_key_says_how_to_give_one() -> None:
    with pytest.raises(client.NoAPIKey, match="^no API key: pass --api-key or set SLUICE_API_KEY$"):
        client.bearer_metadata("")
    with pytest.raises(client.NoAPIKey, match="^no API key: pass --tenant-key"):
        client.bearer_metadata("", "pass --tenant-key/--api-key or set SLUICE_API_KEY")


@pytest.mark.parametrize(
    ("argv", "command", "message"),
    [
        (["models"], cmd_models, "sluice: no API key: pass --api-key or set SLUICE_API_KEY"),
        (["logs"], cmd_logs, "sluice: no API key: pass --tenant-key/--api-key or set SLUICE_API_KEY"),
    ],
)
def test_commands_without_a_key_stop_before_calling(argv: list[str], command, message: str) -> None:  # type: ignore[no-untyped-def]
    args = build_parser().parse_args(["--api-key", "", *argv])
    with pytest.raises(SystemExit) as stopped:
        command(args)
    assert str(stopped.value) == message


def test_no_tls_settings_mean_plaintext() -> None:
    assert client.tls_from_env({}) is None


def test_tls_settings_that_do_not_fit_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="SLUICE_TLS_CERT_FILE and SLUICE_TLS_KEY_FILE go together"):
        client.tls_from_env({"SLUICE_TLS_CERT_FILE": str(tmp_path)})


def _health_server(credentials: grpc.ServerCredentials | None) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", credentials) if credentials else server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A health server over TLS whose certificate names `sluice.test`, and its CA's PEM file."""
    ca = trustme.CA()
    cert = ca.issue_cert("sluice.test")
    credentials = grpc.ssl_server_credentials([(cert.private_key_pem.bytes(), cert.cert_chain_pems[0].bytes())])
    server, address = _health_server(credentials)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    yield address, ca_file
    server.stop(0)


def test_a_plaintext_channel_reaches_a_plaintext_server(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SLUICE_TLS", "SLUICE_TLS_CA_FILE", "SLUICE_TLS_CERT_FILE", "SLUICE_TLS_KEY_FILE", "SLUICE_TLS_SERVER_NAME"):
        monkeypatch.delenv(name, raising=False)
    server, address = _health_server(None)
    try:
        assert _grpc_health(address) == "SERVING"
    finally:
        server.stop(0)


def test_tls_from_the_environment_reaches_a_tls_server(tls_server: tuple[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    address, ca_file = tls_server
    monkeypatch.delenv("SLUICE_TLS", raising=False)
    assert _grpc_health(address).startswith("UNREACHABLE")  # plaintext to a TLS port
    monkeypatch.setenv("SLUICE_TLS_CA_FILE", str(ca_file))
    assert _grpc_health(address).startswith("UNREACHABLE")  # 127.0.0.1 is not the certificate's name
    monkeypatch.setenv("SLUICE_TLS_SERVER_NAME", "sluice.test")
    assert _grpc_health(address) == "SERVING"


def test_the_aio_channel_takes_the_same_tls(tls_server: tuple[str, Path]) -> None:
    """diagnose's probe and GetUsage calls run on grpc.aio channels."""
    address, ca_file = tls_server
    tls = client.tls_from_env({"SLUICE_TLS_CA_FILE": str(ca_file), "SLUICE_TLS_SERVER_NAME": "sluice.test"})

    async def check() -> int:
        async with client.aio_channel(address, tls) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status

    assert asyncio.run(check()) == health_pb2.HealthCheckResponse.SERVING


def _big_reply_server() -> tuple[grpc.Server, str]:
    """A server whose /test.Big/Get answers 5 MiB: a page of long results is as large."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    identity = lambda b: b  # noqa: E731 - raw bytes on the wire
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: b"x" * (5 * 1024 * 1024), identity, identity)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Big", {"Get": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def test_the_channels_read_a_reply_over_grpcs_default_4_mib(monkeypatch: pytest.MonkeyPatch) -> None:
    """A page of 1000 results with long outputs or logprobs is over 4 MiB: it was RESOURCE_EXHAUSTED."""
    for name in ("SLUICE_TLS", "SLUICE_TLS_CA_FILE", "SLUICE_TLS_CERT_FILE", "SLUICE_TLS_KEY_FILE", "SLUICE_TLS_SERVER_NAME"):
        monkeypatch.delenv(name, raising=False)
    server, address = _big_reply_server()
    try:
        with client.channel(address) as sync_channel:
            assert len(sync_channel.unary_unary("/test.Big/Get")(b"", timeout=10)) == 5 * 1024 * 1024

        async def aio_get() -> int:
            async with client.aio_channel(address) as aio:
                return len(await aio.unary_unary("/test.Big/Get")(b"", timeout=10))

        assert asyncio.run(aio_get()) == 5 * 1024 * 1024
    finally:
        server.stop(0)


def test_logs_filters_by_user_and_metadata_pairs(capsys) -> None:  # type: ignore[no-untyped-def]
    args = build_parser().parse_args(["logs", "--user", "u-7", "--metadata", "run=eval-3", "--metadata", "expr=a=b"])
    assert (args.user, args.metadata) == ("u-7", [("run", "eval-3"), ("expr", "a=b")])
    for bad in ("run", "=eval-3"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["logs", "--metadata", bad])
        assert "expected KEY=VALUE" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["logs", "--since", "1e12"], "a duration is 0 (all) up to 100 years"),
        (["logs", "--since", "inf"], "a duration is 0 (all) up to 100 years"),
        (["logs", "--since=-5m"], "a duration is 0 (all) up to 100 years"),
        (["logs", "--follow", "--interval=-1"], "a polling interval is a positive number of seconds"),
        (["logs", "--interval", "nan"], "a polling interval is a positive number of seconds"),
    ],
)
def test_logs_options_out_of_range_are_refused_by_the_parser_not_a_traceback(capsys, argv: list[str], said: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(argv)
    assert stopped.value.code == 2 and said in capsys.readouterr().err


def test_jobs_submit_of_a_file_that_cannot_be_read_says_so(tmp_path: Path) -> None:
    from sluice_cli.jobs import read_rows

    with pytest.raises(SystemExit, match=r"sluice: cannot read .*missing\.jsonl: No such file or directory"):
        read_rows(tmp_path / "missing.jsonl")
    latin1 = tmp_path / "rows.jsonl"
    latin1.write_bytes(b'{"custom_id": "caf\xe9"}\n')
    with pytest.raises(SystemExit, match="not UTF-8 text"):
        read_rows(latin1)


def test_jobs_submit_splits_its_rows_at_newlines_only(tmp_path: Path) -> None:
    """A JobRow's prompt may hold U+2028 or U+0085 unescaped: str.splitlines cut the row there."""
    from sluice_cli.jobs import read_rows

    path = tmp_path / "rows.jsonl"
    path.write_text('{"custom_id": "r1", "generate": {"model": "m", "prompt": "a\u2028b\u0085c"}}\r\n\n', encoding="utf-8")
    [row] = read_rows(path)
    assert row.generate.prompt == "a\u2028b\u0085c"
