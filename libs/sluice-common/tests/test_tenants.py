from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from sluice_common.errors import Unauthenticated
from sluice_common.tenants import TenantDirectory, authorization, bearer_key, hash_api_key

REPO_TENANTS = Path(__file__).resolve().parents[3] / "config" / "tenants.toml"


def write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(body)
    return path


def test_keys_are_stored_hashed_and_authenticate(tmp_path: Path) -> None:
    path = write(tmp_path, f'[[tenants]]\nname = "acme"\napi_key_sha256 = "{hash_api_key("k-1")}"\ntext_logging = false\n')
    assert "k-1" not in path.read_text()
    tenant = TenantDirectory.from_file(path).authenticate("Bearer k-1")
    assert tenant.name == "acme" and tenant.text_logging is False


def test_bearer_scheme_is_case_insensitive_and_key_trimmed(tmp_path: Path) -> None:
    path = write(tmp_path, f'[[tenants]]\nname = "acme"\napi_key_sha256 = "{hash_api_key("k-1")}"\n')
    assert TenantDirectory.from_file(path).authenticate("bearer  k-1 ").name == "acme"


@pytest.mark.parametrize(
    ("header", "message"),
    [(None, "missing"), ("", "missing"), ("Basic abc", "must be `Bearer"), ("Bearer ", "must be `Bearer"), ("Bearer nope", "invalid API key")],
)
def test_bad_credentials(header, message, tmp_path: Path) -> None:
    path = write(tmp_path, f'[[tenants]]\nname = "acme"\napi_key_sha256 = "{hash_api_key("k-1")}"\n')
    with pytest.raises(Unauthenticated, match=message):
        TenantDirectory.from_file(path).authenticate(header)


@pytest.mark.parametrize("body", ['[[tenants]]\nname = "x"\napi_key_sha256 = "short"\n', "", '[[tenants]]\napi_key_sha256 = "' + "a" * 64 + '"\n'])
def test_malformed_files_are_rejected_with_a_reason(body: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tenants"):
        TenantDirectory.from_file(write(tmp_path, body))


def test_the_shipped_demo_file_loads() -> None:
    directory = TenantDirectory.from_file(REPO_TENANTS)
    assert directory.authenticate("Bearer sk-sluice-demo").name == "demo"
    assert directory.authenticate("Bearer sk-sluice-private").text_logging is False


async def _authorization_seen_by_a_server(metadata: tuple[tuple[str, str], ...]) -> str:
    """What `authorization` reads from a real call's context (the handler echoes it, or <none>)."""

    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return (authorization(context) or "<none>").encode()

    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(echo)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", {"Call": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            return (await channel.unary_unary("/test.Echo/Call")(b"", metadata=metadata, timeout=5)).decode()
    finally:
        await server.stop(0)


async def test_authorization_is_read_from_the_call_metadata() -> None:
    assert await _authorization_seen_by_a_server((("x-other", "a"), ("authorization", "Bearer k-1"))) == "Bearer k-1"
    assert await _authorization_seen_by_a_server((("x-other", "a"),)) == "<none>"


@pytest.mark.parametrize(
    ("value", "key"),
    [("Bearer k-1", "k-1"), ("bearer  k-1 ", "k-1"), ("BEARER k-1", "k-1"), ("Basic abc", ""), ("Bearer ", ""), ("", ""), (None, "")],
)
def test_bearer_key(value: str | None, key: str) -> None:
    assert bearer_key(value) == key


def test_one_key_for_two_tenants_is_refused_naming_both(tmp_path: Path) -> None:
    """Collapsed silently, the key logged in as whichever tenant came last."""
    key = hash_api_key("k-1")
    body = f'[[tenants]]\nname = "acme"\napi_key_sha256 = "{key}"\n[[tenants]]\nname = "globex"\napi_key_sha256 = "{key.upper()}"\n'
    with pytest.raises(ValueError, match=r"tenants\[1\] \(globex\) has the api_key_sha256 of tenant acme"):
        TenantDirectory.from_file(write(tmp_path, body))
