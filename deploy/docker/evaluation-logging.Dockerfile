# syntax=docker/dockerfile:1.7
# evaluation-logging: built from the repository root so that libs/ is shared, not copied around:
#   docker build -f deploy/docker/evaluation-logging.Dockerfile -t sluice/evaluation-logging .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.13.9

FROM ${UV_IMAGE} AS uv

# Builder: resolves nothing, installs exactly services/evaluation-logging/uv.lock into /app/.venv.
FROM ${PYTHON_IMAGE} AS builder
COPY --from=uv /uv /usr/local/bin/uv
ENV UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy UV_PYTHON_DOWNLOADS=never \
    UV_PROJECT_ENVIRONMENT=/app/.venv
WORKDIR /src
COPY libs/ libs/
COPY services/evaluation-logging/ services/evaluation-logging/
WORKDIR /src/services/evaluation-logging
# --no-editable: the libs are installed into the venv, so the final stage needs no source tree.
RUN uv sync --locked --no-dev --no-editable

# Final stage: the slim interpreter and the venv; no compilers, no uv, no source.
FROM ${PYTHON_IMAGE}
# /var/lib/sluice: the state directory, the user's own, so that a named volume mounted there starts
# out writable (Docker copies the image's directory and its owner into an empty volume). The SQLite
# evaluations (when SLUICE_EVALLOG_DATABASE_URL is empty) are there by default, as compose and the
# manifests set it: the config's own default is relative to /app, which the user cannot write.
RUN groupadd --system --gid 10001 sluice \
 && useradd --system --uid 10001 --gid sluice --no-create-home --shell /usr/sbin/nologin sluice \
 && install -d -o 10001 -g 10001 /var/lib/sluice
COPY --from=builder /app/.venv /app/.venv
ENV PATH=/app/.venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    SLUICE_EVALLOG_HOST=0.0.0.0 SLUICE_EVALLOG_LOG_JSON=true \
    SLUICE_EVALLOG_SQLITE_PATH=/var/lib/sluice/evallog.sqlite3
WORKDIR /app
USER 10001:10001
EXPOSE 50081 9104
# gRPC health (grpc.health.v1), over TLS when SLUICE_EVALLOG_TLS_CERT_FILE is set.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-m", "sluice_common.healthcheck", "SLUICE_EVALLOG_", "50081"]
ENTRYPOINT ["python", "-m", "sluice_evaluation_logging"]
