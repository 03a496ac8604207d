#!/usr/bin/env bash
# The GPU checks of docs/pytorch.md ("On a GPU"), on a machine with a CUDA
# GPU, torch and no network, from a wheel built elsewhere (pip wheel .):
#
#   examples/gpu_run.sh tally-0.1.0-py3-none-linux_x86_64.whl [tally-bench]
#
# 1. installs the wheel into a venv that sees the system's torch (or, with
#    no venv module, unpacks it into a directory on PYTHONPATH);
# 2. the staging benchmark: a bucket from a CUDA tensor against the same
#    bucket from a CPU tensor, through the hook, W ranks sharing the GPU;
# 3. trains the transformer of examples/train_ddp.py on the GPU, W ranks
#    sharing it, with: no communication, gloo, the tally hook, the hook on the
#    bfloat16 wire, init_process_group("tally"), nccl; then prints each
#    one's median step and its loss beside gloo's;
# 4. runs the Python tests from outside the source tree, CUDA cases included;
# 5. with a tally-bench given: a bench run at the machine's scale.
#
# Each step has its own time limit and the next runs whatever it gave. Logs
# and JSON go to $OUT (default /tmp/gpu-run). DEVICE=cpu runs the same
# plumbing without a GPU; STEPS, W and S size it.
set -u
wheel=$(readlink -f "${1:?usage: gpu_run.sh WHEEL [TALLY_BENCH]}")
bench=${2:+$(readlink -f "$2")}
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/gpu-run}
device=${DEVICE:-cuda}
steps=${STEPS:-12}
W=${W:-4}
S=${S:-4}
mkdir -p "$out"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

step() { # NAME SECONDS COMMAND...: runs it with a deadline, its output in $out/NAME.log
    local name=$1 limit=$2 start rc
    shift 2
    echo "=== $name: $*"
    start=$(date +%s)
    timeout -k 5 "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    tail -n "${TAIL:-25}" "$out/$name.log"
    echo "=== $name: exit $rc after $(($(date +%s) - start)) s"
}

step machine 60 bash -c 'nvidia-smi -L; nproc; python3 -c "
import sys, torch, torch.distributed as d
print(sys.version.split()[0], \"torch\", torch.__version__, \"cuda\", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"-\", \"nccl\", d.is_nccl_available())
for m in (\"numpy\", \"pytest\"):
    try: __import__(m); print(m, \"yes\")
    except ImportError: print(m, \"no\")"'

# 1. The wheel.
py=python3
if python3 -m venv --system-site-packages "$scratch/venv" >"$out/venv.log" 2>&1 &&
    "$scratch/venv/bin/python" -c "import torch" >>"$out/venv.log" 2>&1 &&
    "$scratch/venv/bin/python" -m pip install --no-deps --no-index "$wheel" >>"$out/venv.log" 2>&1; then
    py=$scratch/venv/bin/python
    echo "=== wheel: installed into a venv with pip"
else
    python3 -m zipfile -e "$wheel" "$scratch/site"
    chmod +x "$scratch/site/tally/_bin/tally-reducer"
    export PYTHONPATH=$scratch/site
    echo "=== wheel: unpacked onto PYTHONPATH (no venv with pip and torch: $(tail -n 1 "$out/venv.log"))"
fi
cd "$scratch" # outside the source tree from here on
step import 60 "$py" -c "import tally, tally.torch, tally.pool; print(tally.__file__); print(tally.pool.find_reducer())"

# 2. The staging benchmark.
step staging 120 "$py" "$repo/examples/bench_hook.py" --bench none --devices "cpu,$device" \
    --sizes 4M,25M --workers "$W" --shards "$S" --warmup 5 --iters 20

# 3. Training on the GPU.
for backend in none gloo tally tally-bf16 tally-pg nccl; do
    [ "$backend" = nccl ] && [ "$device" != cuda ] && continue
    limit=150
    [ "$backend" = nccl ] && limit=60 # nccl refuses ranks that share a GPU
    TAIL=3 TALLY_INNER_BACKEND=gloo step "train-$backend" $limit "$py" "$repo/examples/train_ddp.py" \
        --device "$device" --model transformer --backend "$backend" --world-size "$W" \
        --shards "$S" --steps "$steps" --json "$out/train-$backend.json"
done
"$py" - "$out" <<'EOF'
import json, os, sys
out = sys.argv[1]
runs = {}
for name in sorted(os.listdir(out)):
    if name.startswith("train-") and name.endswith(".json"):
        with open(os.path.join(out, name)) as f:
            r = json.load(f)
        runs[r["backend"]] = r
gloo = runs.get("gloo", {}).get("loss")
print("%-11s %9s %12s %14s" % ("backend", "median ms", "final loss", "max |loss-gloo|"))
for backend, r in runs.items():
    diff = max(abs(a - b) for a, b in zip(r["loss"], gloo)) if gloo else float("nan")
    print("%-11s %9.1f %12.6f %14.2e" % (backend, r["median_step_ms"], r["loss"][-1], diff))
EOF

# 4. The Python tests (the install test builds from source: not here).
if "$py" -c "import pytest, numpy" 2>/dev/null; then
    TAIL=8 step pytest 180 "$py" -m pytest -q -p no:cacheprovider "$repo/tests/python" \
        --ignore "$repo/tests/python/test_install.py"
else
    echo "=== pytest: skipped, no pytest or numpy under $py"
fi

# 5. The bench at this machine's scale.
if [ -n "$bench" ]; then
    lib=$("$py" -c "import os, tally; print(os.path.join(os.path.dirname(tally.__file__), '_lib'))")
    reducer=$("$py" -c "import tally.pool; print(tally.pool.find_reducer())")
    for ws in "8 4" "16 8"; do
        set -- $ws
        TAIL=12 LD_LIBRARY_PATH=$lib TALLY_REDUCER=$reducer step "bench-W$1-S$2" 90 \
            "$bench" -W "$1" -S "$2" -b 1M -e 64M -f 4 -n 10 --timeout-s 80
    done
fi
