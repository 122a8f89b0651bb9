#!/usr/bin/env bash
# Build the SGLang server environment for a CPU machine: its own venv, every package pinned
# (scripts/sglang_cpu/requirements.txt), plus two fixes described below. The trainer keeps its own environment:
# sglang 0.5.21 pins transformers 5.12.1, the trainer needs 5.24.
#
# Usage: bash scripts/setup_sglang_env.sh            (prints the venv's python on its last line)
# Env:   SGLANG_VENV      where the venv goes (default: $HOME/.cache/minimind-rl/sglang-venv, outside the
#                         repository, so it survives between CI runs on the same machine)
#        SGLANG_PIP_ARGS  extra pip arguments, e.g. an index that serves the CPU build of torch 2.13.0
#        PYTHON           the interpreter that makes the venv (default: python3; sglang 0.5.21 ships cp311 wheels)
#
# Idempotent: a marker file in the venv holds a digest of the pinned list, the sgl_kernel placeholder and
# BUILD_VERSION; when it matches, nothing is done. Otherwise the venv is built in a temporary folder and moved into
# place, so an interrupted build never leaves a half-made venv behind. Exits non-zero with the reason when the
# environment cannot be built (no python3.11, no registry, a CUDA build of torch).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${SGLANG_VENV:-$HOME/.cache/minimind-rl/sglang-venv}"
PYTHON="${PYTHON:-python3}"
REQUIREMENTS="$ROOT/scripts/sglang_cpu/requirements.txt"
PLACEHOLDER="$ROOT/scripts/sglang_cpu/sgl_kernel"
MARKER_NAME=".minimind-sglang-env"
BUILD_VERSION=1  # raise it whenever the build steps or the fixes below change

digest="$({ cat "$REQUIREMENTS" "$PLACEHOLDER/__init__.py"; echo "$BUILD_VERSION"; } | sha256sum | cut -d' ' -f1)"
if [[ -f "$VENV/$MARKER_NAME" && "$(cat "$VENV/$MARKER_NAME")" == "$digest" ]]; then
    echo "SGLang server environment already built ($VENV, digest ${digest:0:12})" >&2
    echo "$VENV/bin/python"
    exit 0
fi

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
    echo "cannot build the SGLang server environment: $PYTHON is not Python 3.11 (sglang 0.5.21 ships cp311" \
         "wheels); set PYTHON=/path/to/python3.11" >&2
    exit 1
fi

started=$SECONDS
mkdir -p "$(dirname "$VENV")"
build="$VENV.tmp-$$"
trap 'rm -rf "$build"' EXIT
echo "building the SGLang server environment in $VENV (about 3.4 GB, a few minutes)" >&2
"$PYTHON" -m venv "$build"
# (pip's notes about index locations that do not exist on this machine are left out of the log)
"$build/bin/python" -m pip install -q --no-deps ${SGLANG_PIP_ARGS:-} -r "$REQUIREMENTS" 2>&1 \
    | { grep -v "^WARNING: Location '.*' is ignored" || true; } >&2

site_packages="$("$build/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

if ! "$build/bin/python" -c 'import sys, torch; sys.exit(torch.version.cuda is not None)'; then
    echo "cannot build the SGLang server environment: pip installed a CUDA build of torch 2.13.0; give it an" \
         "index with the CPU build (2.13.0+cpu) through SGLANG_PIP_ARGS=--extra-index-url ..." >&2
    exit 1
fi

# Fix 1, torchvision. sglang pulls torchvision 0.28.0, whose PyPI wheel is a CUDA build: beside the CPU torch its
# compiled ops do not load, and two unguarded register_fake("torchvision::nms" / "torchvision::qnms") calls in
# torchvision/_meta_registrations.py then fail at `import sglang` ("operator torchvision::nms does not exist").
# The two registrations are skipped when torchvision.extension._has_ops() is false (the file's other
# registrations already carry that guard). Unnecessary with a CPU build of torchvision 0.28 (not on PyPI) or a
# torchvision release that guards them.
"$build/bin/python" - "$site_packages/torchvision/_meta_registrations.py" <<'PY'
import re
import sys

path = sys.argv[1]
source = open(path).read()
guarded, count = re.subn(r'^@torch\.library\.register_fake\("(torchvision::\w+)"\)$',
                         r'@(torch.library.register_fake("\1") if torchvision.extension._has_ops() else (lambda fn: fn))',
                         source, flags=re.M)
if count != 2:
    sys.exit(f"{path}: expected 2 unguarded register_fake lines, found {count}: the torchvision fix needs a look")
open(path, "w").write(guarded)
PY

# Fix 2, sgl_kernel. With SGLANG_USE_CPU_ENGINE=1 sglang imports sgl_kernel, whose CPU build is not on PyPI (the
# PyPI wheels of sglang-kernel are CUDA builds). On a CPU without AMX the dense model runs on torch-native layers
# and only assign_req_to_token_pool_cpu is called; scripts/sglang_cpu/sgl_kernel implements it in torch and
# answers every other name with a function that raises NotImplementedError. Unnecessary where a CPU build of
# sgl-kernel can be installed (then AMX machines also get SGLang's AMX kernels).
cp -r "$PLACEHOLDER" "$site_packages/"

SGLANG_USE_CPU_ENGINE=1 "$build/bin/python" -c 'import sglang.srt.entrypoints.http_server' >&2

echo "$digest" > "$build/$MARKER_NAME"
rm -rf "$VENV"
mv "$build" "$VENV"
# The move leaves the console scripts' shebangs naming the build folder; everything here runs as `python -m`,
# and bin/python links to $PYTHON's installation, so the moved venv works.
trap - EXIT
echo "built $VENV in $((SECONDS - started)) s" >&2
echo "$VENV/bin/python"
