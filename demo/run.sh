#!/usr/bin/env bash
# The demo: a throwaway serving environment with the real upstream wheels, and one operator
# session against it. Nothing outside .demo/ is written: the two wheels are kept in
# .demo/wheels between runs (copied from sm120patch's wheel cache when it has them, else
# downloaded), and pip and sm120patch use that directory alone.
set -euo pipefail
cd "$(dirname "$0")/.."
DEMO=${SM120PATCH_DEMO_DIR:-.demo}  # the tests run it elsewhere
rm -rf "$DEMO/venv" "$DEMO/home"
mkdir -p "$DEMO/wheels"
export SM120PATCH_WHEEL_CACHE="$(cd "$DEMO/wheels" && pwd)" PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# pip's user agent asks `rustc --version`; where rustc is rustup's proxy, that writes ~/.rustup.
export RUSTUP_HOME="$SM120PATCH_WHEEL_CACHE/../rustup"

echo "# Setting up $DEMO/venv with the real flashinfer-python 0.6.4 and sglang 0.5.9 wheels (no dependencies)"
python -m venv --without-pip "$DEMO/venv"
WHEELS=$(python - <<'PY'
import os, shutil
from pathlib import Path

from sm120patch import wheels

demo = Path(os.environ.pop("SM120PATCH_WHEEL_CACHE"))
found = []
for name, version in (("flashinfer-python", "0.6.4"), ("sglang", "0.5.9")):
    wheel = wheels.cached_wheel(name, version, demo)
    if wheel is None:
        shared = wheels.cached_wheel(name, version, wheels.default_cache()) if wheels.default_cache().is_dir() else None
        wheel = Path(shutil.copy2(shared, demo)) if shared else wheels.fetch_wheel(name, version, demo)
    found.append(str(wheel))
print(" ".join(found))
PY
)
python -m pip --python "$DEMO/venv/bin/python" install --quiet --no-deps --no-compile $WHEELS

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

CODES=()
run() {
    echo
    echo "\$ sm120patch $*"
    local code=0
    sm120patch "$@" --python "$DEMO/venv/bin/python" --jit-cache-base "$DEMO/home" || code=$?
    [ "$code" = 0 ] || explain "$code"
    CODES+=("$1 $code")
}

site_hash() {  # every file of the environment's site-packages (sm120patch's own state aside), hashed
    (cd "$DEMO/venv/lib"/python3*/site-packages && find . -path ./.sm120patch -prune -o -type f -print0 \
        | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-12)
}

explain() {  # the README's exit codes
    case "$1" in
        1) echo "(exit code 1: something is not patched; a script can test for it)" ;;
        3) echo "(exit code 3: refused; nothing was changed)" ;;
        *) echo "(exit code $1)" ;;
    esac
}

BEFORE=$(site_hash)
run status
run apply --flashinfer 0.6.4 --sglang 0.5.9
run status
run revert
run status
AFTER=$(site_hash)

echo
echo "# JIT cache modules left in $DEMO/home/.cache/flashinfer/0.6.4:"
(cd "$DEMO/home/.cache/flashinfer/0.6.4" && find . -mindepth 3 -maxdepth 3 -type d ! -name tmp | sort)

# One line: what each step exited with, and whether revert gave back the release's bytes.
IFS=,; steps="${CODES[*]}"; unset IFS
same=$([ "$BEFORE" = "$AFTER" ] && echo "byte-identical to before apply" || echo "NOT what it was before apply")
echo
echo "demo: exit codes ${steps//,/ -> }; site-packages after revert: $same (sha256 $AFTER)"
[ "$BEFORE" = "$AFTER" ] && [ "${CODES[*]}" = "status 1 apply 0 status 0 revert 0 status 1" ]
