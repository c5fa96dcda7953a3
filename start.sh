#!/usr/bin/env bash
# PolyStrata: set up (first run) and start.
#   ./start.sh              set up if needed, then open the app (the engine runs the embedded default model
#                           when no other model is configured)
#   ./start.sh --headless   set up if needed, then serve the OpenAI-compatible API without a window
#   ./start.sh --setup-only set up and exit
# Any other arguments are passed on to the app (or, with --headless, to `strata-engine serve`).
# Environment: STRATA_EXTRAS=test (extra dependency sets), STRATA_PYTHON (interpreter to build the venv with),
#              STRATA_TORCH=cpu|cuda (override the GPU detection).
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$(pwd)
VENV="$ROOT/.venv"

say() { printf '[polystrata] %s\n' "$*" >&2; }

find_python() {
    for c in "${STRATA_PYTHON:-}" python3.13 python3.12 python3.11 python3; do
        [ -n "$c" ] || continue
        if command -v "$c" >/dev/null 2>&1 &&
            "$c" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
            echo "$c"; return 0
        fi
    done
    return 1
}

setup() {
    if [ ! -x "$VENV/bin/python" ]; then
        py=$(find_python) || { say "Python 3.11 or newer is needed: install it (python.org or your package manager) and run this again."; exit 1; }
        say "creating the virtual environment in .venv with $py"
        "$py" -m venv "$VENV"
        "$VENV/bin/python" -m pip install -q --upgrade pip
    fi
    PY="$VENV/bin/python"
    if ! "$PY" -c 'import torch' >/dev/null 2>&1; then
        want=${STRATA_TORCH:-}
        if [ -z "$want" ]; then
            if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then want=cuda; else want=cpu; fi
        fi
        if [ "$want" = cuda ]; then
            say "NVIDIA driver found: installing PyTorch with CUDA (about 3 GB to download)"
            "$PY" -m pip install "torch>=2.4"
        else
            say "no NVIDIA driver found: installing the CPU build of PyTorch"
            # A local CPU wheel where the machine has one, else PyTorch's CPU index (about 200 MB).
            if "$PY" -m pip install -q --no-index --no-deps "torch==2.13.0" >/dev/null 2>&1; then
                "$PY" -m pip install -q "torch==2.13.0"  # its own dependencies, from the package index
            else
                "$PY" -m pip install --retries 1 "torch>=2.4" --index-url https://download.pytorch.org/whl/cpu \
                    --extra-index-url https://pypi.org/simple || "$PY" -m pip install "torch>=2.4"
            fi
        fi
    fi
    extras=${STRATA_EXTRAS:-}
    spec="."
    [ -n "$extras" ] && spec=".[$extras]"
    # The stamp holds pyproject.toml's hash and the extras installed: fewer extras than installed (./start.sh after
    # ./test.sh) need nothing new, so nothing is reinstalled (offline too).
    stamp="$VENV/.polystrata-installed"
    hash=$(sha256sum pyproject.toml | cut -d' ' -f1)
    read -r had_hash had_extras < "$stamp" 2>/dev/null || { had_hash=; had_extras=; }
    need=0
    [ "$had_hash" = "$hash" ] || need=1
    for x in ${extras//,/ }; do
        case ",$had_extras," in *",$x,"*) ;; *) need=1 ;; esac
    done
    if [ "$need" = 1 ]; then
        for x in ${had_extras//,/ }; do  # keep the extras already there
            case ",$extras," in *",$x,"*) ;; *) extras="${extras:+$extras,}$x" ;; esac
        done
        [ -n "$extras" ] && spec=".[$extras]"
        say "installing PolyStrata and its dependencies ($spec)"
        "$PY" -m pip install -q -e "$spec"
        echo "$hash $extras" > "$stamp"
    fi
}

mode=app
args=()
for a in "$@"; do
    case "$a" in
        --headless) mode=headless ;;
        --setup-only) mode=setup ;;
        *) args+=("$a") ;;
    esac
done

case "$mode:${args[0]:-}" in
    app:--help|app:-h)
        sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
        exit 0 ;;
esac

setup
case "$mode" in
    setup) say "set-up complete"; exit 0 ;;
    headless) exec "$VENV/bin/strata" --headless "${args[@]}" ;;  # the configured model unless told another
    app)
        # a display and Qt's system libraries, or a message that says what to do (no abort inside Qt)
        "$VENV/bin/python" -m installer.qt_libs || exit $?
        exec "$VENV/bin/strata" "${args[@]}" ;;
esac
