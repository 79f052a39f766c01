#!/usr/bin/env bash
# On a machine with an NVIDIA GPU, from the repo root: builds llama-cpp-python with CUDA into
# triton-local's environment and runs `make bench-gpu`'s measurement (GPU vs CPU decode tok/s at
# batch 1, 8, 32, 64; greedy tokens identical?). Needs the NVIDIA driver, a CUDA toolkit (nvcc),
# cmake and a C++ compiler, and the package registry (uv fetches triton-local's locked packages).
# The CUDA build, for this GPU's architecture alone, takes a few minutes on 16 cores; a second run
# reuses it. EXTRA_CMAKE_ARGS adds flags (e.g. -DGGML_CUDA_FA=OFF: a faster build, no flash attention).
set -euo pipefail
cd "$(dirname "$0")/../.."

command -v nvidia-smi >/dev/null && nvidia-smi -L || { echo "run_on_device: no nvidia-smi or no GPU: no NVIDIA driver here" >&2; exit 3; }
venv_python=services/triton-local/.venv/bin/python
has_cuda_build() { [ -x "$venv_python" ] && ls "$("$venv_python" -c 'import llama_cpp, os; print(os.path.dirname(llama_cpp.__file__))')"/lib/libggml-cuda* >/dev/null 2>&1; }

if ! has_cuda_build; then
  if ! command -v nvcc >/dev/null; then
    for dir in /usr/local/cuda/bin /usr/local/cuda-*/bin; do [ -x "$dir/nvcc" ] && export PATH="$dir:$PATH" && break; done
  fi
  if ! command -v nvcc >/dev/null; then
    cat >&2 <<'MSG'
run_on_device: no nvcc (not on PATH, not in /usr/local/cuda*): the CUDA build needs a CUDA toolkit.
  Debian/Ubuntu: add NVIDIA's CUDA apt repository and `apt-get install cuda-toolkit-12-8` (a 12.x no newer
  than the "CUDA Version" nvidia-smi prints), or start from an nvidia/cuda:12.x-devel image.
  PyPI: nvidia-cuda-nvcc-cu12 ships ptxas but no nvcc, so it cannot build this. The CUDA 13 wheels
  (nvidia-cuda-nvcc, nvidia-cublas, nvidia-cuda-cccl; a toolkit root in site-packages/nvidia/cu13) do ship
  nvcc and need a driver >= 580; this script has not been tried with them.
MSG
    exit 4
  fi
  nvcc --version | tail -n 2
  arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d ' .')
  # The Makefile's portable CPU flags (no -march=native: some VMs report AMX and refuse it), AVX-512
  # where the CPU has it (the CPU side of the comparison should not be held back), CUDA for this GPU.
  avx512=OFF; grep -qw avx512f /proc/cpuinfo && avx512=ON
  export CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$arch -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON \
    -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=$avx512 -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
    -DGGML_AMX_BF16=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
    -DLLAMA_BUILD_SERVER=OFF ${EXTRA_CMAKE_ARGS:-}"
  export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
  make --no-print-directory uv
  uv=$(command -v uv || echo "$PWD/.tools/bin/uv")
  "$uv" cache clean llama-cpp-python  # else uv reuses a wheel it built earlier with other flags
  echo "building llama-cpp-python with CUDA (sm_$arch) into services/triton-local/.venv ..."
  (cd services/triton-local && "$uv" sync --locked --reinstall-package llama-cpp-python)
  has_cuda_build || { echo "run_on_device: the build finished without libggml-cuda" >&2; exit 5; }
fi

# Straight from triton-local's environment: `make bench-gpu` would first sync every project.
exec "$venv_python" -m sluice_triton_local.engine.bench_gpu
