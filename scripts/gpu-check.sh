#!/usr/bin/env bash
# The GPU checks of the engine data path, in one call on the GPU machine (about 2-3 minutes):
# the gpu-marked tests, then bench/gpu_copy.py, then a short table against the data path's goals.
#
# Here first:  scripts/fetch-gpu-wheels.sh   (lmdb, grpcio-health-checking, grpcio-reflection
#              as Python 3.12 wheels in .whl/, which that machine lacks)
# Then:        device run, carry [".whl"], command "bash scripts/gpu-check.sh"
#
# Writes $OUT/gpu-tests.log, $OUT/daemon-logs.txt, $OUT/bench.log and $OUT/bench.json when $OUT is set.
# Then SGLang live (scripts/sglang_live_check.py: a tiny model served with and without kvtier as
# its HiCache storage) where SGLang with its CUDA kernels imports; else skipped, saying so. It
# writes $OUT/sglang.log and $OUT/sglang.json; SGLANG_CHECK_S bounds it (default 420 s).
# REHEARSE=1 runs the same steps on a CPU machine (stand-in tests, a small host bench) to
# check the script itself.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/kvtier-gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}

if [ "${REHEARSE:-0}" != 1 ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing .whl/ failed"; exit 1; }
fi
# kvtier's packages map to top-level folders (pyproject package-dir): assemble them without
# building anything, since nothing can be downloaded there.
PKG=/tmp/kvtier-pkg
rm -rf "$PKG" && mkdir -p "$PKG/kvtier"
cp "$ROOT"/kvtier/*.py "$PKG/kvtier/"
for part in proto tiers daemon client; do ln -s "$ROOT/$part" "$PKG/kvtier/$part"; done
export PYTHONPATH="$PKG:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# The checkout's own kvtier/ (only __init__.py and paths.py) must not shadow the assembled package:
# python3 - and python3 -m put the working directory first on sys.path unless this is set.
export PYTHONSAFEPATH=1
MARK=gpu; ENGINE=cuda; BENCH_ARGS=(); GPU_MODS='"cupy", "cuda.bindings.runtime"'
if [ "${REHEARSE:-0}" = 1 ]; then
  MARK="not gpu"; ENGINE=host; BENCH_ARGS=(--blocks 16 --samples 50); GPU_MODS=""
fi

"$PY" - <<EOF || exit 1
import importlib
for m in ("grpc", "grpc_health", "grpc_reflection", "lmdb", "torch", "kvtier.daemon.server", $GPU_MODS):
    importlib.import_module(m)
import torch, grpc, google.protobuf
print(f"torch {torch.__version__} cuda={torch.cuda.is_available()} "
      f"grpc {grpc.__version__} protobuf {google.protobuf.__version__}")
EOF
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
# the kernel says which sandbox runs this (gVisor reports 4.4.0): CUDA IPC, cudaHostRegister of
# shared memory and MADV_POPULATE_WRITE depend on it
echo "kernel $(uname -r)"

echo "== gpu-marked tests"
# SIGINT (not TERM) so that pytest still prints its summary; each test at most 40 s, so that one
# hung test leaves time for the others; the daemons' logs under a known directory
BASE=/tmp/kvtier-gpu-pytest
rm -rf "$BASE"
timeout -s INT -k 10 150 "$PY" -m pytest -v -p no:cacheprovider -o timeout=40 --basetemp="$BASE" -m "$MARK" \
  tests/test_gpu_path.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -40
tests_rc=${PIPESTATUS[0]}
find "$BASE" -name '*.log' 2>/dev/null | while read -r f; do echo "== $f"; tail -n 40 "$f"; done \
  >"$OUT/daemon-logs.txt"

echo "== bench/gpu_copy.py"
PYTHONPATH="$ROOT/bench:$PYTHONPATH" timeout -s INT -k 10 150 "$PY" bench/gpu_copy.py --engine "$ENGINE" \
  "${BENCH_ARGS[@]}" --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | tail -4
bench_rc=${PIPESTATUS[0]}

"$PY" - "$OUT/bench.json" "$tests_rc" "$bench_rc" <<'EOF'
import json, sys
path, tests_rc, bench_rc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
print(f"\ngpu tests: {'PASS' if tests_rc == 0 else f'FAIL (rc {tests_rc})'}; bench rc {bench_rc}")
try:
    r = json.load(open(path))
except (OSError, ValueError):
    sys.exit(1)
goals = {"ratio_engine": (">=", 0.95), "ratio_end_to_end": (">=", 0.90), "pin_s_per_gib": ("<=", 0.1)}
rows = ["backend", "engine_offload_gbps", "engine_onboard_gbps", "offload_gbps", "onboard_gbps", "bulk_d2h_gbps",
        "bulk_h2d_gbps", "ratio_engine", "ratio_end_to_end", "onboard_1block_p50_us", "onboard_1block_p99_us",
        "onboard_1block_p99_under_offload_us", "pin_s_per_gib"]
print(f"{'metric':40s} {'value':>12s}  goal")
for k in rows:
    goal = ""
    if k in goals:
        op, g = goals[k]
        ok = r[k] >= g if op == ">=" else r[k] <= g
        goal = f"{op} {g}  {'ok' if ok else 'MISSED'}"
    print(f"{k:40s} {str(r.get(k)):>12s}  {goal}")
EOF

echo "== sglang live check"
sglang_rc=0
if [ "${REHEARSE:-0}" = 1 ]; then
  echo "sglang live check: skipped (REHEARSE: it needs a GPU)"
elif ! sglang_why=$("$PY" -c 'import sglang, sgl_kernel, torch; assert torch.cuda.is_available(), "no CUDA device"' 2>&1 | tail -1); then
  echo "sglang live check: skipped (SGLang with its CUDA kernels does not import here: $sglang_why)"
else
  PYTHONPATH="$PYTHONPATH:$ROOT" timeout -s INT -k 20 "${SGLANG_CHECK_S:-420}" "$PY" scripts/sglang_live_check.py \
    --out "$OUT/sglang.json" --workdir "$(mktemp -d /tmp/kvtier-sglang.XXXXXX)" 2>&1 | tee "$OUT/sglang.log" | tail -30
  sglang_rc=${PIPESTATUS[0]}
  echo "sglang live check: $([ "$sglang_rc" = 0 ] && echo PASS || echo "FAIL (rc $sglang_rc)")"
fi

exit $(( tests_rc != 0 || bench_rc != 0 || sglang_rc != 0 ))
