#!/usr/bin/env bash
# The GPU checks and GPU figures in one run, for a machine with CUDA (README, "Tests").
#
# That machine has its own python3 with a CUDA torch but no Ray and no registry access: this script
# uses that python3, installs grpcio/protobuf from wheels carried in .gpu_wheels/ when present (the
# committed stubs need grpcio >= 1.80.1), runs tests/gpu, then the benches that take a device, plus
# the CPU-bound benches on that machine's many cores. Logs go to $OUT (default /tmp/duet-gpu-out).
#
#     bash tests/gpu/device_check.sh [quick]
set -u
OUT=${OUT:-/tmp/duet-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD RAY_USAGE_STATS_ENABLED=0
quick=${1:-}

section() { echo; echo "=== $* ($(date +%T))"; }
step() {  # step NAME SECONDS COMMAND...: run with a time limit, keep the log, never stop the script
    local name=$1 limit=$2
    shift 2
    section "$name"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 40 "$OUT/$name.log"
    echo "--- $name: exit $rc"
}

section "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "cores: $(nproc)"
if [ -d .gpu_wheels ]; then
    python3 -m pip install -q --no-index --no-deps --find-links .gpu_wheels \
        grpcio protobuf grpcio-health-checking grpcio-reflection 2>&1 | tail -n 3
fi
python3 - <<'EOF'
import importlib.metadata as metadata
import sys

import torch

print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())
for name in ("grpcio", "protobuf", "msgpack", "xxhash", "numpy", "pytest", "pytest-timeout", "hypothesis"):
    try:
        print(f"  {name} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(f"  {name} MISSING")
EOF

step gpu_tests 300 python3 -m pytest -q -p no:cacheprovider -rA tests/gpu
if [ "$quick" = quick ]; then
    step engine_cuda 120 python3 bench/engine_bench.py --device cuda --quick
    exit 0
fi
step engine_cuda 180 python3 bench/engine_bench.py --device cuda
step handover_cuda 150 python3 bench/handover_latency.py --device cuda --dtype bfloat16 --prompt-tokens 2048 --max-num-tokens 512 --repeats 10
step transfer_16core 150 python3 bench/transfer_bench.py
step transfer_16core_2x2 120 python3 bench/transfer_bench.py --streams 2 --connections 2 --repetitions 5
step scheduler_16core 200 python3 bench/scheduler_bench.py
