# syntax=docker/dockerfile:1.7
# gateway: built from the repository root so that libs/ is shared, not copied around:
#   docker build -f deploy/docker/gateway.Dockerfile -t sluice/gateway .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.13.9

FROM ${UV_IMAGE} AS uv

# Builder: resolves nothing, installs exactly services/gateway/uv.lock into /app/.venv.
FROM ${PYTHON_IMAGE} AS builder
COPY --from=uv /uv /usr/local/bin/uv
ENV UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy UV_PYTHON_DOWNLOADS=never \
    UV_PROJECT_ENVIRONMENT=/app/.venv
WORKDIR /src
COPY libs/ libs/
COPY services/gateway/ services/gateway/
WORKDIR /src/services/gateway
# --no-editable: the libs are installed into the venv, so the final stage needs no source tree.
RUN uv sync --locked --no-dev --no-editable

# Final stage: the slim interpreter and the venv; no compilers, no uv, no source.
FROM ${PYTHON_IMAGE}
# /var/lib/sluice: the state directory, the user's own, so that a named volume mounted there starts
# out writable (Docker copies the image's directory and its owner into an empty volume). The jobs
# SQLite is there by default (as compose and the manifests set it): the config's own default is
# relative to the working directory, /app, which the user cannot write. The job worker runs this
# image too and must share that file with the gateway (the same volume).
RUN groupadd --system --gid 10001 sluice \
 && useradd --system --uid 10001 --gid sluice --no-create-home --shell /usr/sbin/nologin sluice \
 && install -d -o 10001 -g 10001 /var/lib/sluice
COPY --from=builder /app/.venv /app/.venv
ENV PATH=/app/.venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    SLUICE_GATEWAY_HOST=0.0.0.0 SLUICE_GATEWAY_LOG_JSON=true \
    SLUICE_GATEWAY_JOBS_SQLITE_PATH=/var/lib/sluice/jobs.sqlite3
WORKDIR /app
USER 10001:10001
# 8080: the OpenAI-compatible HTTP API, off unless SLUICE_GATEWAY_HTTP_PORT=8080 (compose and the
# manifests set it); HTTPS only, with the gRPC port's certificate, when SLUICE_GATEWAY_TLS_CERT_FILE is set.
EXPOSE 50051 8080 9101
# gRPC health (grpc.health.v1), over TLS when SLUICE_GATEWAY_TLS_CERT_FILE is set.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-m", "sluice_common.healthcheck", "SLUICE_GATEWAY_", "50051"]
ENTRYPOINT ["python", "-m", "sluice_gateway"]
