# syntax=docker/dockerfile:1.7
# rate-limit: built from the repository root so that libs/ is shared, not copied around:
#   docker build -f deploy/docker/rate-limit.Dockerfile -t sluice/rate-limit .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.13.9

FROM ${UV_IMAGE} AS uv

# Builder: resolves nothing, installs exactly services/rate-limit/uv.lock into /app/.venv.
FROM ${PYTHON_IMAGE} AS builder
COPY --from=uv /uv /usr/local/bin/uv
ENV UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy UV_PYTHON_DOWNLOADS=never \
    UV_PROJECT_ENVIRONMENT=/app/.venv
WORKDIR /src
COPY libs/ libs/
COPY services/rate-limit/ services/rate-limit/
WORKDIR /src/services/rate-limit
# --no-editable: the libs are installed into the venv, so the final stage needs no source tree.
RUN uv sync --locked --no-dev --no-editable

# Final stage: the slim interpreter and the venv; no compilers, no uv, no source.
FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 sluice \
 && useradd --system --uid 10001 --gid sluice --no-create-home --shell /usr/sbin/nologin sluice
COPY --from=builder /app/.venv /app/.venv
ENV PATH=/app/.venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    SLUICE_RATELIMIT_HOST=0.0.0.0 SLUICE_RATELIMIT_LOG_JSON=true
WORKDIR /app
USER 10001:10001
EXPOSE 50071 9103
# gRPC health (grpc.health.v1), over TLS when SLUICE_RATELIMIT_TLS_CERT_FILE is set.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-m", "sluice_common.healthcheck", "SLUICE_RATELIMIT_", "50071"]
ENTRYPOINT ["python", "-m", "sluice_rate_limit"]
