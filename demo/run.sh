#!/usr/bin/env bash
# The demo: a throwaway serving environment with the real upstream wheels, and one operator
# session against it. Nothing outside .demo/ is touched.
set -euo pipefail
cd "$(dirname "$0")/.."
DEMO=.demo
rm -rf "$DEMO"
mkdir -p "$DEMO"

echo "# Setting up $DEMO/venv with the real flashinfer-python 0.6.4 and sglang 0.5.9 wheels (no dependencies)"
python -m venv --without-pip "$DEMO/venv"
WHEELS=$(python - <<'PY'
from sm120patch.wheels import fetch_wheel
print(fetch_wheel("flashinfer-python", "0.6.4"), fetch_wheel("sglang", "0.5.9"))
PY
)
python -m pip --python "$DEMO/venv/bin/python" install --quiet --no-deps --no-compile \
    --disable-pip-version-check $WHEELS

# A JIT cache as a server leaves it: trtllm_comm plus other modules, for two arch sets.
# (Stand-in files, so that you can watch sm120patch remove exactly trtllm_comm.)
for arch in 120a 90a_120a; do
    for module in trtllm_comm norm sampling; do
        mkdir -p "$DEMO/home/.cache/flashinfer/0.6.4/$arch/cached_ops/$module"
        echo "demo stand-in" > "$DEMO/home/.cache/flashinfer/0.6.4/$arch/cached_ops/$module/$module.so"
        mkdir -p "$DEMO/home/.cache/flashinfer/0.6.4/$arch/cached_ops/tmp"  # FlashInfer's build locks
        touch "$DEMO/home/.cache/flashinfer/0.6.4/$arch/cached_ops/tmp/$module.lock"
    done
done

run() {
    echo
    echo "\$ sm120patch $*"
    sm120patch "$@" --python "$DEMO/venv/bin/python" --jit-cache-base "$DEMO/home" || echo "(exit code $?)"
}

run status
run apply --flashinfer 0.6.4 --sglang 0.5.9
run status
run revert
run status

echo
echo "# JIT cache modules left in $DEMO/home/.cache/flashinfer/0.6.4:"
(cd "$DEMO/home/.cache/flashinfer/0.6.4" && find . -mindepth 3 -maxdepth 3 -type d ! -name tmp | sort)
