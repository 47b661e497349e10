#!/usr/bin/env bash
# Every GPU check and benchmark in one command, for one short stay on a GPU machine:
#
#     benchmarks/gpu_all.sh [RESULTS_DIR]          (default: gpu-results)
#
# It writes RESULTS_DIR/summary.md (the machine, then every part's figures) and each
# part's full output beside it. The parts run in order of what matters most, each under
# its own time limit; GPU_SUITE_SECONDS (if set) bounds the whole, and a part that would
# start past it is skipped and says so; GPU_SUITE_PARTS=snapshot,recovery runs only those
# (a rerun). A part that fails or runs out of time is marked in the summary and the rest
# still run. Without CUDA the GPU parts say "skipped" at once, and the rest (live
# re-formation on the CPU, the rendezvous at scale) runs.
set -u
cd "$(dirname "$0")/.."
out=${1:-gpu-results}
mkdir -p "$out"
summary="$out/summary.md"
py=${PYTHON:-python3}
budget=${GPU_SUITE_SECONDS:-0}
only=${GPU_SUITE_PARTS:-} # e.g. snapshot,recovery: run these parts alone (a rerun)
cuda=$($py -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')

{
    echo "# elastic-run GPU suite, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo
    echo '```'
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 ||
        echo "no nvidia-smi"
    $py -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda,
        "devices", torch.cuda.device_count())'
    echo "CPUs: $(nproc); commit: $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    echo '```'
} >"$summary"

part() { # name, seconds, command... : stdout holds the figures, stderr the logs
    local name=$1 limit=$2
    shift 2
    case ",${only:-$name}," in *",$name,"*) ;; *) return ;; esac
    if [ "$budget" -gt 0 ]; then
        local left=$((budget - SECONDS))
        if [ "$left" -lt 20 ]; then
            printf '\n## %s: skipped (the suite'"'"'s %s s were spent)\n' "$name" "$budget" >>"$summary"
            return
        fi
        [ "$left" -lt "$limit" ] && limit=$left
    fi
    local start=$SECONDS rc
    echo "== $name (at most ${limit}s)" >&2
    timeout -k 10 "$limit" "$@" >"$out/$name.out" 2>"$out/$name.err"
    rc=$?
    {
        printf '\n## %s: %s s, exit %s' "$name" "$((SECONDS - start))" "$rc"
        [ "$rc" = 124 ] && printf ' (out of time: %s s)' "$limit"
        printf '\n\n`%s`\n\n```\n' "$*"
        tail -n 80 "$out/$name.out"
        if [ "$rc" != 0 ]; then
            echo "--- the end of its stderr:"
            tail -n 30 "$out/$name.err"
        fi
        echo '```'
    } >>"$summary"
}

# every-step snapshots of 1.6 GB (batch 256 and 2048), NVML against nvidia-smi meanwhile
part snapshot 170 $py benchmarks/gpu_metrics.py -- --batches 256,2048
# the framework adapters on the GPU first (their printed figures: -rP), then the rest
part gpu-tests 300 $py -m pytest -q -rfEsP -p no:cacheprovider -m gpu tests/test_gpu_frameworks.py \
    tests/test_gpu.py
# live re-formation with the model on the GPU (gloo ranks on one device) against respawn
part live-cuda 160 $py benchmarks/faults.py --only kill,join --repeat 2 --device "$cuda" \
    --width 2048
part rendezvous-scale 200 $py benchmarks/rendezvous_scale.py --sizes 1024,4096 \
    --c10d-max 0 --etcd-cpus 2 --timeout 60
# every-step snapshots of a model with 1 GB of parameters (3.2 GB with Adam's state)
part snapshot-large 120 $py -m elastic benchmarks/gpu_snapshot.py --width 8192 --layers 4 \
    --batches 4096 --no-peers
part recovery 100 $py benchmarks/gpu_recovery.py --repeat 1
echo "summary: $summary" >&2
