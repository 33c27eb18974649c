#!/usr/bin/env bash
# Every GPU figure and GPU test of the project in one run, for a machine with one CUDA GPU, xmoe and vLLM
# installed (e.g. from an `xmoe wheelhouse`):
#   1. the serving benchmark alone on the GPU (EXL3 against bf16 at the most layers bf16 fits: 4 on 80 GB, 8 above);
#   2. a 10-minute 16-client soak with the GPU test suites beside it (correctness, not timing);
#   3. the per-call fused-MoE figures alone on the GPU, at HEAD and, given OLD (a checkout of another commit),
#      there too, alternating (last: the least needed when the GPU time runs out).
# Results and logs go to OUT; progress.txt says what finished when. SOAK=seconds (0: the tests alone), PREFILL.
#   bash benchmarks/gpu_check.sh OUT [OLD]
set -uo pipefail
out=$(realpath -m "${1:?usage: gpu_check.sh OUT [OLD]}"); old=${2:-}
cd "$(dirname "$0")/.." && mkdir -p "$out" || exit 1
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
stamp() { echo "$(date +%T) $*" >> "$out/progress.txt"; }

# XMOE_COMMIT names a copy of the tree without its own .git (or with a stale one)
stamp "start ${XMOE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
layers=4; [ "${mem:-0}" -gt 120000 ] && layers=8
# PREFILL: the prompt lengths timed (fewer where GPU time is short)
timeout 1500 python3 benchmarks/serve_gpu.py --variant "bf16:$layers" "exl3:$layers" --repeats 3 \
    --prefill ${PREFILL:-2048 16384} --vllm-arg=--jit-monitor-verbose \
    --json "$out/serve_gpu.json" > "$out/serve_gpu.log" 2>&1
stamp "serve_gpu rc=$?"
cp /tmp/xmoe-serve-gpu/server-*.log "$out/" 2>/dev/null
# the profiled decode steps' traces, for where the step's time outside the kernels goes
[ -d /tmp/xmoe-serve-gpu ] && tar -czf "$out/traces.tgz" -C /tmp/xmoe-serve-gpu $(cd /tmp/xmoe-serve-gpu && ls -d trace-*) 2>/dev/null

soak= soak_s=${SOAK:-600}
if [ "$soak_s" -gt 0 ]; then
    timeout $((soak_s + 900)) python3 benchmarks/serve_gpu.py --variant exl3:4 --soak-only --soak "$soak_s" --streams 16 \
        --gpu-memory 0.4 --port 8392 --work /tmp/xmoe-soak --vllm-arg=--jit-monitor-verbose \
        --json "$out/soak.json" > "$out/soak.log" 2>&1 &
    soak=$!
    sleep 150  # the soak server's start-up, before the tests share the GPU
fi
# Both suites at once, so that they fit inside the soak's 10 minutes.
timeout 1800 python3 -m pytest -q -ra tests/vllm/test_serve_gpu.py > "$out/test_serve_gpu.log" 2>&1 &
serve_tests=$!
timeout 1800 python3 -m pytest -q -ra -m gpu -n 4 tests --ignore=tests/vllm/test_serve_gpu.py \
    > "$out/test_gpu_suite.log" 2>&1
stamp "gpu suite rc=$?"
wait $serve_tests
stamp "test_serve_gpu rc=$?"
if [ -n "$soak" ]; then
    wait $soak
    stamp "soak rc=$?"
    for f in /tmp/xmoe-soak/server-*.log; do cp "$f" "$out/soak-$(basename "$f")"; done 2>/dev/null
fi

for tree in . "$old" . "$old"; do
    [ -n "$tree" ] || continue
    if [ "$tree" = . ] && [ -n "${XMOE_COMMIT:-}" ]; then name=$XMOE_COMMIT
    else name=$(git -C "$tree" rev-parse --short HEAD 2>/dev/null) || name=$([ "$tree" = . ] && echo head || basename "$tree")
    fi
    (cd "$tree" && PYTHONPATH=$PWD timeout 600 python3 benchmarks/moe_kernel.py --no-stock --tokens 1 6 12 48 1542 \
        --json "$out/moe_kernel_${name}_$(date +%s).json" >> "$out/moe_kernel_$name.log" 2>&1)
    stamp "moe_kernel $name rc=$?"
done

stamp done
