#!/usr/bin/env bash
# The session run on the lent H200 (SM90, driver, CUDA 13.0, torch 2.11; no internet) for
# docs/h200.md. Wheels travel in .whl/: flashinfer-python 0.6.4, sglang 0.5.9, and for the
# image's Python 3.12: apache-tvm-ffi (FlashInfer needs it) and libcst (sm120patch needs it).
#   bash benchmarks/h200_session.sh build     # doctor, apply, verify, build + load, cuobjdump, revert
#   bash benchmarks/h200_session.sh restart   # the JIT restart-cost benchmark
#   bash benchmarks/h200_session.sh warm      # apply --build: its time, and the first use after it
#   bash benchmarks/h200_session.sh owner     # root runs apply --build for nobody's cache base, on a tty
#   bash benchmarks/h200_session.sh gpu-test  # the test suite's GPU test (pytest -m gpu), with this venv
#   bash benchmarks/h200_session.sh unicast   # doctor's driver reading; SymmDeviceMemory without multicast, pristine/patched
#   bash benchmarks/h200_session.sh stub      # a GPU-less apply --build (no libcuda for the link), then its first use here
#   bash benchmarks/h200_session.sh clamp     # the cluster clamp: the query per kernel; pristine vs patched bit-identical;
#                                             # a test-only build whose clamp answers 1 against a float32 reference
#   bash benchmarks/h200_session.sh ranks     # TP2/4/8 with every rank a process on this one GPU: pytest -m gpu
#                                             # tests/test_one_gpu.py, pristine vs patched (docs/one-gpu.md)
#   bash benchmarks/h200_session.sh tuned     # issue #52 on this one GPU: SGLang 0.5.9's layer under a tuned-limits
#                                             # profile (TP2, TP4), and `bench --tune` end to end (docs/tuning.md)
#   bash benchmarks/h200_session.sh tuned-releases  # issue #60: SGLang 0.5.9's and 0.5.21's tuned layers under a
#                                             # profile made on this box, TP2 and TP4, ranks on this one GPU
#   bash benchmarks/h200_session.sh pcie-ipc  # the servers' PCIe-IPC allreduce + norm as bench --tune makes and
#                                             # checks it, ranks on this one GPU (benchmarks/pcie_ipc_one_gpu.py)
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"

# The serving environment: a venv that sees the image's torch, with the real wheels in it.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/sm-deps .whl/libcst-*.whl
python3 -m venv /tmp/env
python3 -c 'import site; print(site.getsitepackages()[0])' > "$(/tmp/env/bin/python -c 'import site; print(site.getsitepackages()[0])')/image.pth"
case "${1:-build}" in clamp|ranks|tuned|tuned-releases|pcie-ipc) ;; *) false;; esac || /tmp/env/bin/python -m pip install -q --no-index --no-deps --no-compile .whl/flashinfer_python-*.whl .whl/apache_tvm_ffi-*.whl .whl/sglang-*.whl
export PYTHONPATH=$PWD/src:/tmp/sm-deps
P=(--python /tmp/env/bin/python --jit-cache-base /tmp/ws)
step() { echo; echo "\$ $*"; "$@"; echo "(exit code $?)"; }
sm120patch() { python3 -m sm120patch "$@"; }
build_and_load() { FLASHINFER_CUDA_ARCH_LIST="$1" FLASHINFER_WORKSPACE_BASE=/tmp/ws /tmp/env/bin/python benchmarks/trtllm_comm_build_and_load.py; }

case "${1:-build}" in
tuned-releases)
    # Issue #60 on this one GPU: SGLang's tuned layer, as patched, under a profile made on this box,
    # on 0.5.9 (with flashinfer-python 0.6.4, patched by sm120patch) and on 0.5.21 (with the 0.6.18
    # it pins, upstream-fixed: nothing of FlashInfer to patch), TP2 then TP4 while TUNED_BUDGET lasts.
    # The layers' files (.servers/patched/sglang-tuned-VER/) come from `one_gpu_ranks.py servers
    # --suites sglang-tuned-0.5.9,sglang-tuned-0.5.21`, run where the wheels are.
    T0=$(date +%s)
    RES=$OUT/tuned && mkdir -p $RES
    left() { echo $(( ${TUNED_BUDGET:-560} - ($(date +%s) - T0) )); }
    export FLASHINFER_CUDA_ARCH_LIST=9.0a
    # The image has click, packaging and pytest; sm120patch's other needs travel.
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/sm-deps --upgrade .whl/gitpython-*.whl \
        .whl/gitdb-*.whl .whl/smmap-*.whl .whl/libcst-*.whl
    nvidia-smi --query-gpu=name,compute_cap,driver_version,pci.bus_id --format=csv,noheader | tee $RES/gpu.txt
    for fi in 0.6.4 0.6.18; do
        d=/tmp/fi-$fi
        [ -e $d/.ready ] && continue
        python3 -m venv $d
        python3 -c 'import site; print(site.getsitepackages()[0])' > "$($d/bin/python -c 'import site; print(site.getsitepackages()[0])')/image.pth"
        $d/bin/python -m pip install -q --no-index --no-deps --no-compile .whl/flashinfer_python-$fi-*.whl .whl/apache_tvm_ffi-*.whl
        step python3 -m sm120patch apply --python $d/bin/python --jit-cache-base $d/ws 2>&1 | tee $RES/apply-$fi.txt
        for module in "comm.trtllm_ar import get_trtllm_comm_module as g" "norm import get_norm_module as g"; do
            ( FLASHINFER_WORKSPACE_BASE=$d/ws MAX_JOBS=8 /usr/bin/time -f "$fi ${module%% *}: %e s" $d/bin/python -c "from flashinfer.$module; g()" \
                > $RES/build-$fi-${module%% *}.txt 2>&1 ) &
        done
        touch $d/.ready
    done
    wait
    echo "== builds ($(( $(date +%s) - T0 )) s): $(tail -qn 1 $RES/build-*.txt | tr '\n' ' ')"
    for node in "0.6.4 sglang-tuned-0.5.9 2" "0.6.18 sglang-tuned-0.5.21 2" "0.6.4 sglang-tuned-0.5.9 4" "0.6.18 sglang-tuned-0.5.21 4"; do
        set -- $node
        [ "$(left)" -gt 60 ] || { echo "skip $node: $(left) s left"; continue; }
        t=$(( $(left) - 40 )); [ $t -gt 200 ] && t=200
        env SM120PATCH_GPU_PYTHON=/tmp/fi-$1/bin/python SM120PATCH_ONE_GPU_SERVERS=$PWD/.servers SM120PATCH_ONE_GPU_OUT=$RES \
            SM120PATCH_ONE_GPU_TUNED_SUITE=$2 SM120PATCH_ONE_GPU_TIMEOUT=$t timeout $(( 2 * t + 30 )) python3 -m pytest -m gpu \
            --noconftest -p no:cacheprovider -q -s -rA tests/test_one_gpu.py -k "sglang_layer and $3" < /dev/null > $RES/pytest-$2-tp$3.txt 2>&1
        echo "== $2 TP$3 (pytest exit $?, $(( $(date +%s) - T0 )) s): $(tail -n 1 $RES/pytest-$2-tp$3.txt)"
    done
    ;;
pcie-ipc)
    # FlashInfer 0.7.0 (.whl/: flashinfer_python-0.7.0, apache_tvm_ffi, cuda_tile) in a venv that
    # sees the image's torch; SGLang and vLLM are not installed (their dependencies do not travel),
    # so the worker makes FlashInfer's workspace with each server's arguments and says so. Every
    # rank a process on GPU 0 over gloo; correctness only. PCIE_WORLDS: the TP sizes (default 2: the
    # first call also builds pcie_ipc_comm and tunes under time slicing; PCIE_WORLDS=4 in a second).
    # FlashInfer's autotune over SGLang's 512 rows (tune batches 1..512) does not finish in one call
    # under time slicing (docs/tuning.md): SGLANG_PCIE_IPC_MAX_NUMEL=65536 (16 rows at hidden 4096),
    # PCIE_PATHS=sglang-pcie-ipc PCIE_TOKENS=1,8,16 is the run recorded there.
    d=/tmp/fi-0.7.0-pcie
    if [ ! -e $d/.ready ]; then
        python3 -m venv $d
        python3 -c 'import site; print(site.getsitepackages()[0])' > "$($d/bin/python -c 'import site; print(site.getsitepackages()[0])')/image.pth"
        $d/bin/python -m pip install -q --no-index --no-deps --no-compile .whl/flashinfer_python-0.7.0-*.whl \
            .whl/apache_tvm_ffi-*.whl $(ls .whl/cuda_tile-*.whl 2>/dev/null) && touch $d/.ready
    fi
    nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader
    for w in ${PCIE_WORLDS:-2}; do
        step env FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE=$d/ws $d/bin/python \
            benchmarks/pcie_ipc_one_gpu.py run --world $w --paths ${PCIE_PATHS:-sglang-pcie-ipc,vllm-pcie-ipc} \
            --tokens ${PCIE_TOKENS:-1,8,64,512,1024} --out "$OUT/pcie-ipc-tp$w.json" --timeout ${PCIE_TIMEOUT:-420}
    done
    ;;
unicast)
    # Multicast is reported absent inside the test process only; no cuMulticast* call reaches the driver.
    step sm120patch doctor "${P[@]}" 2>&1 | tee "$OUT/doctor.txt"
    step /tmp/env/bin/python benchmarks/unicast_workspace_gpu.py | tee "$OUT/unicast-pristine.json"
    step sm120patch apply "${P[@]}"
    step /tmp/env/bin/python benchmarks/unicast_workspace_gpu.py | tee "$OUT/unicast-patched.json"
    step sm120patch revert "${P[@]}"
    step sm120patch status "${P[@]}"
    ;;
build)
    step nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total,pci.bus_id --format=csv
    step sm120patch doctor "${P[@]}" 2>&1 | tee "$OUT/doctor.txt"
    step sm120patch status "${P[@]}"
    step build_and_load 12.0a
    step sm120patch apply "${P[@]}"
    step sm120patch verify "${P[@]}" --runtime --compile
    step build_and_load "9.0a 12.0a"
    step sm120patch status "${P[@]}"
    step sm120patch revert "${P[@]}"
    step build_and_load 12.0a
    ;;
warm)
    # 1. Plain apply: the server's first use compiles trtllm_comm.
    step sm120patch apply "${P[@]}"
    step env FLASHINFER_WORKSPACE_BASE=/tmp/ws /tmp/env/bin/python benchmarks/first_use.py --label "first use after apply"
    step sm120patch revert "${P[@]}"
    # 2. apply --build: sm120patch compiles it (FlashInfer's JIT, every core), the server does not.
    step /usr/bin/time -f "apply --build wall time: %e s" python3 -m sm120patch apply "${P[@]}" --build
    step env FLASHINFER_WORKSPACE_BASE=/tmp/ws /tmp/env/bin/python benchmarks/first_use.py --label "first use after apply --build"
    step sm120patch status "${P[@]}"
    # 3. build on an already patched environment: nothing to compile, proven at once.
    step sm120patch build "${P[@]}"
    step sm120patch revert "${P[@]}"
    ;;
owner)
    # Root patches a service user's server: the cache base belongs to nobody, so the build runs as
    # nobody and every file of the entry is nobody's. Under script(1) so that ninja's [n/m] steps
    # reach a terminal and the progress bar is drawn.
    rm -rf /tmp/ws2 && mkdir /tmp/ws2 && chown nobody:nogroup /tmp/ws2
    Q=(--python /tmp/env/bin/python --jit-cache-base /tmp/ws2)
    step script -qefc "PYTHONPATH=$PYTHONPATH python3 -m sm120patch apply ${Q[*]} --build" /dev/null
    step sh -c "find /tmp/ws2 ! -user nobody | head; echo \"files not nobody's: \$(find /tmp/ws2 ! -user nobody | wc -l) of \$(find /tmp/ws2 | wc -l)\""
    step setpriv --reuid nobody --regid nogroup --clear-groups env HOME=/tmp/ws2 FLASHINFER_WORKSPACE_BASE=/tmp/ws2 \
        /tmp/env/bin/python benchmarks/first_use.py --label "first use as nobody after root's apply --build"
    step sm120patch revert "${Q[@]}"
    ;;
gpu-test)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/sm-deps --upgrade .whl/pytest-*.whl \
        .whl/pluggy-*.whl .whl/iniconfig-*.whl .whl/click-*.whl .whl/packaging-*.whl .whl/gitpython-*.whl \
        .whl/gitdb-*.whl .whl/smmap-*.whl .whl/libcst-*.whl
    step env SM120PATCH_GPU_PYTHON=/tmp/env/bin/python SM120PATCH_WHEEL_CACHE=$PWD/.whl \
        python3 -m pytest -m gpu -v -p no:cacheprovider tests/test_build.py
    ;;
stub)
    # A GPU-less image build on this machine: no GPU visible, a view of the toolkit without
    # lib64/stubs, LIBRARY_PATH unset (the image sets it to the toolkit's stubs), and the driver's
    # development link libcuda.so (what -lcuda finds; nothing loads it, the loader takes
    # libcuda.so.1) moved aside for the build, then put back.
    echo "LIBRARY_PATH of this image: ${LIBRARY_PATH:-unset}"
    NOLIB=(env -u LIBRARY_PATH)
    CUDA=$(python3 -c 'from sm120patch.jitbuild import cuda_home; print(cuda_home())')
    REAL=$(ldconfig -p | awk '/libcuda\.so\.1 /{print $NF; exit}')
    rm -rf /tmp/cudaview && mkdir -p /tmp/cudaview/lib64
    for e in "$CUDA"/*; do [ "$(basename "$e")" = lib64 ] || ln -s "$e" "/tmp/cudaview/$(basename "$e")"; done
    for e in "$CUDA"/lib64/*; do [ "$(basename "$e")" = stubs ] || ln -s "$e" "/tmp/cudaview/lib64/$(basename "$e")"; done
    HIDDEN=()
    for f in /lib/libcuda.so /usr/lib/libcuda.so /lib/x86_64-linux-gnu/libcuda.so /usr/lib/x86_64-linux-gnu/libcuda.so \
             /usr/local/nvidia/lib64/libcuda.so /usr/lib64/libcuda.so; do
        if [ -e "$f" ] || [ -L "$f" ]; then mv "$f" "$f.hidden-by-sm120patch" 2>/dev/null && HIDDEN+=("$f"); fi
    done
    restore() { for f in "${HIDDEN[@]}"; do mv "$f.hidden-by-sm120patch" "$f"; done; HIDDEN=(); }
    trap restore EXIT
    echo "moved aside for the build: ${HIDDEN[*]:-nothing}"
    step python3 -c "from pathlib import Path; from sm120patch.jitbuild import libcuda_for_link as f; print('toolkit:', f(Path('$CUDA')).describe())"
    step "${NOLIB[@]}" python3 -c "from pathlib import Path; from sm120patch.jitbuild import libcuda_for_link as f; print('view, no LIBRARY_PATH:', f(Path('/tmp/cudaview')).describe())"
    step sm120patch apply "${P[@]}"
    step /usr/bin/time -f "GPU-less apply --build wall time: %e s" "${NOLIB[@]}" CUDA_HOME=/tmp/cudaview CUDA_VISIBLE_DEVICES= \
        python3 -m sm120patch build "${P[@]}" --arch 9.0a
    restore
    step python3 -c "from pathlib import Path; from sm120patch.jitbuild import libcuda_for_link as f; print('after, view:', f(Path('/tmp/cudaview')).describe())"
    step env CUDA_HOME=/tmp/cudaview FLASHINFER_WORKSPACE_BASE=/tmp/ws /tmp/env/bin/python benchmarks/libcuda_stub_gpu.py \
        --real "$REAL" | tee "$OUT/libcuda-stub.json"
    step sm120patch revert "${P[@]}"
    ;;
clamp)
    # Three serving environments of flashinfer-python 0.6.4 with their own JIT cache bases: pristine,
    # patched by sm120patch, and a test-only copy of the patched one whose GetMaxClusterSize answers 1
    # (what a device without cluster launch gets; this edit is made here only, never by sm120patch).
    # Several ranks share GPU 0 (gloo + CUDA IPC): correctness only, no timings. Idempotent on a warm
    # machine: what is built or run already (under /tmp) is kept, so a second call does the rest.
    T0=$(date +%s)
    RES=/tmp/clamp-results && mkdir -p $RES
    nvidia-smi --query-gpu=name,compute_cap,compute_mode,driver_version --format=csv
    left() { echo $(( ${CLAMP_BUDGET:-560} - ($(date +%s) - T0) )); }
    [ -e /tmp/clamp-setup-done ] || for e in pristine patched clamp1; do
        python3 -m venv /tmp/$e
        python3 -c 'import site; print(site.getsitepackages()[0])' > "$(/tmp/$e/bin/python -c 'import site; print(site.getsitepackages()[0])')/image.pth"
        /tmp/$e/bin/python -m pip install -q --no-index --no-deps --no-compile .whl/flashinfer_python-*.whl .whl/apache_tvm_ffi-*.whl
    done
    [ -e /tmp/clamp-setup-done ] || for e in patched clamp1; do
        python3 -m sm120patch apply --python /tmp/$e/bin/python --jit-cache-base /tmp/ws-$e; done
    C1=$(/tmp/clamp1/bin/python -c 'import flashinfer, pathlib; print(pathlib.Path(flashinfer.__file__).parent / "data/include/flashinfer/comm")')
    [ -e /tmp/clamp-setup-done ] || python3 - "$C1" <<'PY'
import pathlib, sys
head = "inline int GetMaxClusterSize(const void* kernel, int block_dim) {\n"
for name in ("trtllm_allreduce.cuh", "trtllm_allreduce_fusion.cuh", "trtllm_moe_allreduce_fusion.cuh"):
    path = pathlib.Path(sys.argv[1]) / name
    text = path.read_text()
    assert text.count(head) == 1, (name, text.count(head))
    path.write_text(text.replace(head, head + "  if (kernel != nullptr || block_dim > 0) return 1;  // test-only: no cluster launch\n"))
    print(f"test-only edit: {name}: GetMaxClusterSize answers 1")
PY
    touch /tmp/clamp-setup-done
    step python3 -m sm120patch status --python /tmp/patched/bin/python --jit-cache-base /tmp/ws-patched
    # The three builds of trtllm_comm for 9.0a at once, and the probe beside them.
    for e in pristine patched clamp1; do
        [ -e /tmp/built-$e ] && continue
        ( FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE=/tmp/ws-$e /tmp/$e/bin/python \
            benchmarks/trtllm_comm_build_and_load.py > "$RES/build-$e.txt" 2>&1 && touch /tmp/built-$e ) &
    done
    SITE=$(/tmp/patched/bin/python -c 'import site; print(site.getsitepackages()[0])')
    [ -e $RES/probe.json ] || step python3 benchmarks/cluster_clamp_gpu.py probe --site "$SITE" --out $RES/probe.json
    SITE1=$(/tmp/clamp1/bin/python -c 'import site; print(site.getsitepackages()[0])')
    [ -e $RES/probe-clamp1.json ] || step python3 benchmarks/cluster_clamp_gpu.py probe --site "$SITE1" --out $RES/probe-clamp1.json
    wait
    for e in pristine patched clamp1; do echo "== build $e"; grep -v "^ELF file" "$RES/build-$e.txt"; done
    # The cases, most important first, each while time is left.
    for spec in ${CLAMP_SPECS:-pristine:2 patched:2 clamp1:2 clamp1:4 clamp1:8 patched:4 pristine:4 patched:8 pristine:8}; do
        e=${spec%:*}; n=${spec#*:}
        [ -e /tmp/built-$e ] || { echo "skip $e TP$n: not built"; continue; }
        [ -e $RES/$e-tp$n.json ] && continue
        [ "$(left)" -gt 45 ] || { echo "skip $e TP$n: $(left) s left"; continue; }
        step env FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE=/tmp/ws-$e timeout $(( $(left) - 10 )) \
            /tmp/$e/bin/python benchmarks/cluster_clamp_gpu.py run --world $n --label $e \
            --timeout $(( $(left) - 20 )) --out $RES/$e-tp$n.json
    done
    cd $RES
    for n in 2 4 8; do
        [ -e pristine-tp$n.json ] && [ -e patched-tp$n.json ] && \
            step python3 "$OLDPWD/benchmarks/cluster_clamp_gpu.py" compare pristine-tp$n.json patched-tp$n.json
        [ -e clamp1-tp$n.json ] && step python3 "$OLDPWD/benchmarks/cluster_clamp_gpu.py" compare \
            $( [ -e patched-tp$n.json ] && echo patched-tp$n.json) clamp1-tp$n.json
    done
    cd "$OLDPWD"
    tar -czf "$OUT/clamp-results.tar.gz" -C $RES .
    ;;
ranks)
    # Every rank a process on GPU 0 (tests/one_gpu.py). Per FlashInfer release in RANKS_FLASHINFER
    # (wheels in .whl/), two serving environments with their own JIT cache base (<env>/ws):
    # pristine and patched (sm120patch apply), built for 9.0a side by side; then the GPU tier's
    # tests/test_one_gpu.py, one test node at a time while RANKS_BUDGET seconds last. The server
    # files (pristine/ and patched/) come from `one_gpu_ranks.py servers`, run where the wheels are,
    # into RANKS_SERVERS. Idempotent on a warm machine: what is built or has a result is kept.
    T0=$(date +%s)
    RES=/tmp/ranks-results && mkdir -p $RES
    # .ranks-seed/ (carried): an earlier call's results; its .done nodes are not run again.
    [ -d .ranks-seed ] && cp -rn .ranks-seed/. $RES/
    left() { echo $(( ${RANKS_BUDGET:-560} - ($(date +%s) - T0) )); }
    export FLASHINFER_CUDA_ARCH_LIST=9.0a  # the arch the modules were built for, in every rank too
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/sm-deps .whl/libcst-*.whl
    nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader
    for v in ${RANKS_FLASHINFER:-0.6.4}; do
        for e in pristine patched; do
            d=/tmp/fi-$v-$e
            if [ ! -e $d/.ready ]; then
                python3 -m venv $d
                python3 -c 'import site; print(site.getsitepackages()[0])' > "$($d/bin/python -c 'import site; print(site.getsitepackages()[0])')/image.pth"
                extra=$([ "$v" = 0.6.4 ] || ls .whl/cuda_tile-*.whl 2>/dev/null)
                $d/bin/python -m pip install -q --no-index --no-deps --no-compile .whl/flashinfer_python-$v-*.whl \
                    .whl/apache_tvm_ffi-*.whl $extra
                [ $e = pristine ] || python3 -m sm120patch apply --python $d/bin/python --jit-cache-base $d/ws
                touch $d/.ready
            fi
            [ -e $d/.built ] || ( FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE=$d/ws MAX_JOBS=16 \
                $d/bin/python benchmarks/trtllm_comm_build_and_load.py > $RES/build-$v-$e.txt 2>&1 && touch $d/.built ) &
        done
    done
    wait
    for v in ${RANKS_FLASHINFER:-0.6.4}; do for e in pristine patched; do
        echo "== build $v $e: $(grep -v '^ELF file' $RES/build-$v-$e.txt | tr '\n' ' ' | cut -c1-400)"; done; done
    suites_of() {
        case $1 in
            0.6.4) echo legacy,unified,sglang-0.5.9,sglang-0.5.10,sglang-0.5.14,vllm-0.19.0 ;;
            0.6.1[0-4]*) echo legacy,unified,sglang-0.5.14 ;;
            *) echo legacy,unified,vllm-0.29.0 ;;
        esac
    }
    for v in ${RANKS_FLASHINFER:-0.6.4}; do
        mkdir -p $RES/$v
        case $v in 0.6.1[0-4]*)
            # torch symmetric memory (FlashInfer 0.6.10-0.6.14) refuses ranks that share a device
            # unless TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1: once without it (what it says);
            # the tests below run with it set.
            [ -e $RES/$v/patched-no-overlap-tp2.json ] || [ "$(left)" -lt 90 ] || step env -u TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES \
                FLASHINFER_WORKSPACE_BASE=/tmp/fi-$v-patched/ws /tmp/fi-$v-patched/bin/python benchmarks/one_gpu_ranks.py run \
                --world 2 --label patched-no-overlap --suites legacy,unified --timeout 60 --out $RES/$v/patched-no-overlap-tp2.json ;;
        esac
    done
    # One test node at a time, TP2 of every release first (RANKS_NODES: "release|node ..." instead).
    nodes=${RANKS_NODES:-$(for n in "fused and 2" "lamport and 2" "fused and 4" "lamport and 4" "fused and 8" "lamport and 8"; do
        for v in ${RANKS_FLASHINFER:-0.6.4}; do echo "$v|$n"; done; done)}
    while IFS='|' read -r v node; do
        [ -n "$v" ] || continue
        tag=$(echo "$node" | tr -d ' ')
        [ -e $RES/$v/$tag.done ] && continue
        [ "$(left)" -gt 70 ] || { echo "skip $v $node: $(left) s left"; continue; }
        cap=120; case $node in *8) cap=260;; esac  # 8 time-sliced ranks take about twice as long as 4
        t=$(( ($(left) - 30) / 2 )); [ $t -gt $cap ] && t=$cap
        # 0.6.10 and later allocate the legacy workspace through torch symmetric memory too (0.6.16.post4's
        # trtllm_ar.py: _alloc_symm_buffer_bytes), so every such release needs the switch on one GPU.
        case $v in 0.6.[1-9][0-9]*) overlap=1 ;; *) overlap= ;; esac
        env ${overlap:+TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1} \
        SM120PATCH_GPU_PYTHON=/tmp/fi-$v-patched/bin/python SM120PATCH_GPU_PRISTINE_PYTHON=/tmp/fi-$v-pristine/bin/python \
        SM120PATCH_ONE_GPU_SUITES=$(suites_of $v) SM120PATCH_ONE_GPU_SERVERS=${RANKS_SERVERS:-$PWD/.servers} \
        SM120PATCH_ONE_GPU_OUT=$RES/$v SM120PATCH_ONE_GPU_TIMEOUT=$t \
            timeout $(( 2 * t + 50 )) python3 -m pytest -m gpu --noconftest -p no:cacheprovider -q -s -rA \
            tests/test_one_gpu.py -k "$node" < /dev/null > $RES/$v/pytest-$tag.txt 2>&1
        echo "== $v $node (pytest exit $?, $(( $(date +%s) - T0 )) s): $(tail -1 $RES/$v/pytest-$tag.txt)"
        touch $RES/$v/$tag.done
    done <<< "$nodes"
    for v in ${RANKS_FLASHINFER:-0.6.4}; do
        docs=$(for n in 2 4 8; do for e in pristine patched; do [ -e $RES/$v/$e-tp$n.json ] && echo $RES/$v/$e-tp$n.json; done; done)
        [ -z "$docs" ] || python3 benchmarks/one_gpu_ranks.py table $docs > $RES/table-$v.md 2>&1; cat $RES/table-$v.md 2>/dev/null
        for f in $RES/$v/lamport-*.txt; do [ -e "$f" ] && { echo "== $f"; grep -v "^    rank .* flag" "$f" | tail -3; }; done
        [ -e $RES/$v/patched-no-overlap-tp2.json ] && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('no-overlap:', sorted({r.get('error','') for r in d['records'] if 'error' in r})[:3])" $RES/$v/patched-no-overlap-tp2.json
    done
    tar -czf "$OUT/ranks-results.tar.gz" -C $RES .
    ;;
tuned)
    # One patched environment of flashinfer-python 0.6.4 (<env>/ws its JIT cache base), trtllm_comm and
    # norm built for 9.0a side by side, then the GPU tier's issue-#52 tests one node at a time, most
    # important first, while TUNED_BUDGET seconds last. The layer's files (.servers/patched/sglang-tuned-0.5.9/)
    # come from `one_gpu_ranks.py servers --suites sglang-tuned-0.5.9`, run where the wheels are.
    T0=$(date +%s)
    RES=$OUT/tuned && mkdir -p $RES
    left() { echo $(( ${TUNED_BUDGET:-570} - ($(date +%s) - T0) )); }
    export FLASHINFER_CUDA_ARCH_LIST=9.0a
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/sm-deps --upgrade .whl/pytest-*.whl \
        .whl/pluggy-*.whl .whl/iniconfig-*.whl .whl/click-*.whl .whl/packaging-*.whl .whl/gitpython-*.whl \
        .whl/gitdb-*.whl .whl/smmap-*.whl .whl/libcst-*.whl
    nvidia-smi --query-gpu=name,compute_cap,driver_version,pci.bus_id --format=csv,noheader | tee $RES/gpu.txt
    d=/tmp/fi-0.6.4-patched
    python3 -m venv $d
    python3 -c 'import site; print(site.getsitepackages()[0])' > "$($d/bin/python -c 'import site; print(site.getsitepackages()[0])')/image.pth"
    $d/bin/python -m pip install -q --no-index --no-deps --no-compile .whl/flashinfer_python-0.6.4-*.whl .whl/apache_tvm_ffi-*.whl
    step python3 -m sm120patch apply --python $d/bin/python --jit-cache-base $d/ws 2>&1 | tee $RES/apply.txt
    for module in "comm.trtllm_ar import get_trtllm_comm_module as g" "norm import get_norm_module as g"; do
        ( FLASHINFER_WORKSPACE_BASE=$d/ws MAX_JOBS=16 /usr/bin/time -f "${module%% *}: %e s" $d/bin/python -c "from flashinfer.$module; g()" \
            > $RES/build-${module%% *}.txt 2>&1 ) &
    done
    wait
    echo "== builds ($(( $(date +%s) - T0 )) s): $(tail -qn 1 $RES/build-*.txt | tr '\n' ' ')"
    for node in "sglang_layer and 2" "tuner and 2" "sglang_layer and 4"; do
        tag=$(echo "$node" | tr -d ' ')
        [ "$(left)" -gt 60 ] || { echo "skip $node: $(left) s left"; continue; }
        t=$(( $(left) - 40 )); [ $t -gt 240 ] && t=240
        env SM120PATCH_GPU_PYTHON=$d/bin/python SM120PATCH_ONE_GPU_SERVERS=$PWD/.servers SM120PATCH_ONE_GPU_OUT=$RES \
            SM120PATCH_ONE_GPU_TIMEOUT=$t timeout $(( 2 * t + 30 )) python3 -m pytest -m gpu --noconftest -p no:cacheprovider \
            -q -s -rA tests/test_one_gpu.py -k "$node" < /dev/null > $RES/pytest-$tag.txt 2>&1
        echo "== $node (pytest exit $?, $(( $(date +%s) - T0 )) s): $(tail -n 1 $RES/pytest-$tag.txt)"
    done
    ;;
restart)
    step sm120patch apply "${P[@]}"
    step timeout 570 /tmp/env/bin/python benchmarks/jit_restart_cost.py --python /tmp/env/bin/python \
        --arch-list "${ARCHS:-9.0a}" --workspace /tmp/jitws --jobs 8 ${MODULES:+--modules "$MODULES"}
    ;;
esac
