#!/bin/bash
# The full-data grid (bench.grid) on a lent GPU machine whose Python has torch but not all of
# fedrelay's dependencies and no Fashion-MNIST, with no network. Run from the repository root
# there; the cells come back as $OUT/cells.tgz (extract it here, copy the cells into bench/cells/
# and commit them), the logs as $OUT/logs.tgz.
#
# Prepare here, once, in the repository root (both folders are git-ignored by .git/info/exclude
# and must be named in the device call's `carry`):
#   printf '/.whl/\n/.gpu-data/\n' >> .git/info/exclude
#   for spec in grpcio==1.85.1 grpcio-health-checking==1.85.1 protobuf==7.36.2 cryptography==50.0.2 \
#       cffi==2.1.1 pycparser==3.12 starlette==1.10.0 uvicorn==0.54.0 opacus==1.6.0; do
#     python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl "$spec"; done         # the versions of .venv here; cvxopt is needed only for maecho_alpha qp
#   mkdir -p .gpu-data && for f in /usr/share/datasets/fashion-mnist/*.gz; do
#     zcat "$f" | xz -9e > ".gpu-data/$(basename "$f" .gz).xz"; done   # 26 MB: the call carries 64 MiB at most
#
# usage: FEDRELAY_BENCH_COMMIT=<commit here> bash bench/grid_on_gpu.sh SECONDS [bench.grid flags...]
#   e.g. ... bash bench/grid_on_gpu.sh 540 --recipe paper --jobs 8 --methods fedseq_last_epoch,fedelmy-kd
# SECONDS bounds the grid (cells still running then are lost; finished ones are kept). Measured
# 2026-11-28 on an H200 with 16 groups at once: setup 16 s, a FedELMY cell 300-360 s after ~130 s
# of split and daemon start, GPU and CPU both saturated (bench/README.md).
set -u
SECONDS_LEFT=$1; shift
OUT=${OUT:-/tmp/grid-out}; mkdir -p "$OUT"
PY=$(command -v python3)
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
export FEDRELAY_BENCH_COMMIT=${FEDRELAY_BENCH_COMMIT:-unknown}
W=/tmp/grid-gpu; mkdir -p "$W"
{
  set -e
  "$PY" -m pip install -q --no-index --no-deps --no-compile .whl/*.whl
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .
  mkdir -p /usr/share/datasets/fashion-mnist
  "$PY" - <<'EOF'
import gzip, lzma, pathlib, shutil
for f in pathlib.Path(".gpu-data").glob("*.xz"):
    with lzma.open(f) as src, gzip.open(f"/usr/share/datasets/fashion-mnist/{f.stem}.gz", "wb", compresslevel=1) as dst:
        shutil.copyfileobj(src, dst)
EOF
  "$PY" -c "import torch, fedrelay.cli.coordinator; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
} > "$OUT/setup.log" 2>&1 || { echo "setup failed:"; cat "$OUT/setup.log"; exit 3; }
( while true; do echo "== $(date -u +%T)"; uptime; nvidia-smi --query-gpu=utilization.gpu,memory.used \
    --format=csv,noheader 2>/dev/null; sleep 30; done ) > "$W/monitor.log" 2>&1 &
MON=$!
timeout -s TERM "$SECONDS_LEFT" "$PY" -m bench.grid --device cuda --workdir "$W/work" --cells "$W/cells" \
  --results "$W/results.json" --plots "$W/plots" "$@" > "$W/grid.log" 2>&1
echo "bench.grid ended with $?"
kill "$MON" 2>/dev/null
tar czf "$OUT/cells.tgz" -C "$W" cells
tar czf "$OUT/logs.tgz" -C "$W" grid.log monitor.log $(cd "$W" && find work/jobs -maxdepth 1 -name '*.log' 2>/dev/null)
grep -E "%|FAILED|stopping|done in" "$W/grid.log" | tail -40
