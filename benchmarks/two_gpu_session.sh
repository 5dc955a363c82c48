#!/usr/bin/env bash
# The two-GPU session behind docs/two-gpu.md, run on a machine with 2 GPUs (the lent 2 x H200:
# SM90, driver 580, CUDA 13.0, torch 2.11, no internet). Wheels travel in .whl/ (see
# docs/two-gpu.md): flashinfer-python 0.6.4, and for the image's Python 3.12 apache-tvm-ffi
# (FlashInfer) and libcst (sm120patch).
#
# Two serving environments, pristine and patched through `sm120patch apply`, each with its own
# FlashInfer JIT cache; FlashInfer builds trtllm_comm and norm for sm_90a in both, in parallel.
# Then: 1. exactness (every shape, bf16 and fp16, one-shot and two-shot, pristine vs patched),
# 2. the lamport-stride demonstration, 3. `sm120patch bench` timing and its refusals, 4. `bench --tune`
# writing a real profile.
set -u
# NVLink multicast stays off (the lent machine's rule; also what a PCIe box has anyway).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FLASHINFER_CUDA_ARCH_LIST=9.0a
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"

main() {
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/sm-deps .whl/libcst-*.whl
for env in pristine patched; do
    python3 -m venv /tmp/$env
    python3 -c 'import site; print(site.getsitepackages()[0])' \
        > "$(/tmp/$env/bin/python -c 'import site; print(site.getsitepackages()[0])')/image.pth"
    /tmp/$env/bin/python -m pip install -q --no-index --no-deps --no-compile \
        .whl/flashinfer_python-0.6.4-*.whl .whl/apache_tvm_ffi-*.whl
done
export PYTHONPATH=$PWD/src:/tmp/sm-deps
sm120patch() { python3 -m sm120patch "$@"; }
step() { echo; echo "\$ $*"; "$@"; echo "(exit code $?)"; }
TOKENS=1,2,3,7,16,17,64,127,512,1024,2048

step python3 -c 'import torch; print(torch.__version__, torch.cuda.device_count(), torch.cuda.nccl.version())'
step nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total,pci.bus_id --format=csv
step nvidia-smi topo -m
step sm120patch apply --python /tmp/patched/bin/python --jit-cache-base /tmp/ws-patched

echo; echo "# FlashInfer's own JIT builds trtllm_comm and norm for $FLASHINFER_CUDA_ARCH_LIST, both environments at once"
start=$SECONDS
pids=()
for env in pristine patched; do
    for module in "comm.trtllm_ar import get_trtllm_comm_module as g" "norm import get_norm_module as g"; do
        FLASHINFER_WORKSPACE_BASE=/tmp/ws-$env timeout 400 /tmp/$env/bin/python -c "from flashinfer.$module; g()" \
            > "/tmp/build-$env-${module%% *}.log" 2>&1 &
        pids+=($!)
    done
done
wait "${pids[@]}"  # by pid: a bare wait would also wait for tee
echo "built in $((SECONDS - start)) s"; tail -n 3 /tmp/build-*.log
ls /tmp/ws-*/.cache/flashinfer/0.6.4/*/cached_ops/

echo; echo "# 1. exactness: pristine and patched, every shape, one-shot and two-shot"
exact() {  # env dtype
    sm120patch bench --python /tmp/$1/bin/python --jit-cache-base /tmp/ws-$1 --tp 2 --tokens $TOKENS \
        --hidden 4096,7168 --dtype $2 --strategy both --check-only --json > "$OUT/exact-$1-$2.json"
    echo "sm120patch bench --python /tmp/$1/bin/python --tp 2 --tokens $TOKENS --hidden 4096,7168 --dtype $2 --strategy both --check-only --json: exit code $?"
}
start=$SECONDS
for env in pristine patched; do
    exact $env bf16 & a=$!
    exact $env fp16 & b=$!  # check-only runs are light: both dtypes at once
    wait $a $b
done
echo "exactness runs: $((SECONDS - start)) s"
for dtype in bf16 fp16; do
    step python3 benchmarks/compare_exactness.py "$OUT/exact-pristine-$dtype.json" "$OUT/exact-patched-$dtype.json"
done

echo; echo "# 2. lamport-stride: plain custom allreduce, lamport path, world size 2"
for env in pristine patched; do
    FLASHINFER_WORKSPACE_BASE=/tmp/ws-$env step timeout 300 /tmp/$env/bin/python benchmarks/lamport_stride_demo.py \
        --timeout 45 --json "/tmp/lamport-$env.json"
done
python3 -c 'import json,sys; json.dump({e: json.load(open(f"/tmp/lamport-{e}.json")) for e in ("pristine","patched")}, sys.stdout, indent=1)' \
    > "$OUT/lamport.json"

echo; echo "# 3. sm120patch bench on the patched environment"
step sm120patch bench --python /tmp/patched/bin/python --jit-cache-base /tmp/ws-patched
step sm120patch bench --python /tmp/patched/bin/python --jit-cache-base /tmp/ws-patched --tp 4
step sm120patch bench --python /tmp/patched/bin/python --jit-cache-base /tmp/ws-patched --tp 3
CUDA_VISIBLE_DEVICES=0 step sm120patch bench --python /tmp/patched/bin/python --jit-cache-base /tmp/ws-patched

echo; echo "# 4. bench --tune: a real profile (issue #52), NCCL and CUDA graphs, one GPU per rank"
step sm120patch bench --python /tmp/patched/bin/python --jit-cache-base /tmp/ws-patched --tune --tp 2 --hidden 4096 \
    --profile "$OUT/tuned-limits.json"
}

main 2>&1 | tee "$OUT/session.log"
