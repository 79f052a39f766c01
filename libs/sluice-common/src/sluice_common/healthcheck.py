"""`python -m sluice_common.healthcheck PREFIX [DEFAULT_PORT]`: exit 0 when this service is SERVING.

The container HEALTHCHECK and, with TLS on, the Kubernetes exec probe (kubelet's own gRPC probe
speaks plaintext only). It reads the service's own settings: `<PREFIX>PORT` (else DEFAULT_PORT),
and with `<PREFIX>TLS_CERT_FILE` set it dials TLS, verifying the server with
`<PREFIX>TLS_CLIENT_CA_FILE` (else the system roots) and presenting the service's own certificate
(so mutual TLS accepts it). It dials 127.0.0.1 and checks the name in
`SLUICE_HEALTHCHECK_SERVER_NAME` (default `localhost`), which the certificate must carry.
"""

from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _read(path: str) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as file:
        return file.read()


def check(prefix: str, default_port: int, environ: os._Environ[str] | dict[str, str] = os.environ, timeout_s: float = 3.0) -> bool:
    port = environ.get(f"{prefix}PORT") or str(default_port)
    target = f"127.0.0.1:{port}"
    cert_file = environ.get(f"{prefix}TLS_CERT_FILE", "")
    if not cert_file:
        channel = grpc.insecure_channel(target)
    else:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_read(environ.get(f"{prefix}TLS_CLIENT_CA_FILE", "")),
            private_key=_read(environ.get(f"{prefix}TLS_KEY_FILE", "")),
            certificate_chain=_read(cert_file),
        )
        name = environ.get("SLUICE_HEALTHCHECK_SERVER_NAME", "localhost")
        channel = grpc.secure_channel(target, credentials, options=[("grpc.ssl_target_name_override", name)])
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            print(f"unhealthy: {exc.code().name} {exc.details()}", file=sys.stderr)
            return False
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    if not serving:
        print(f"unhealthy: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}", file=sys.stderr)
    return serving


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 2:
        raise SystemExit("usage: python -m sluice_common.healthcheck PREFIX [DEFAULT_PORT]")
    raise SystemExit(0 if check(args[0], int(args[1]) if len(args) == 2 else 0) else 1)


if __name__ == "__main__":
    main()
