#!/bin/sh
# PolyStrata for Linux: uninstall (installed as DIR/lib/polystrata/uninstall.sh and DIR/bin/strata-uninstall).
#   strata-uninstall                  remove the program, its menu entry, autostart entries, settings, chat history
#                                     and caches; downloaded models stay (asks on a terminal)
#   strata-uninstall --remove-models  also delete the models folder
#   strata-uninstall --yes            ask nothing (models stay unless --remove-models)
#   strata-uninstall --program-only   remove the program and its desktop files only; all data stays (upgrades)
set -eu

say() { printf '[polystrata] %s\n' "$*"; }

REMOVE_MODELS=ask
PROGRAM_ONLY=0
ASK=1
[ -t 0 ] && [ -t 1 ] || ASK=0
while [ $# -gt 0 ]; do
    case "$1" in
        --remove-models) REMOVE_MODELS=1 ;;
        --program-only) PROGRAM_ONLY=1 ;;
        --yes|-y) ASK=0 ;;
        -h|--help) sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) printf '[polystrata] error: unknown option %s (see --help)\n' "$1" >&2; exit 1 ;;
    esac
    shift
done

# This script lives in the program folder (through the strata-uninstall link too).
self=$0
while [ -L "$self" ]; do
    target=$(readlink "$self")
    case "$target" in /*) self=$target ;; *) self="$(dirname "$self")/$target" ;; esac
done
APP_DIR=$(cd "$(dirname "$self")" && pwd)
PREFIX=$(dirname "$(dirname "$APP_DIR")")
MANIFEST="$APP_DIR/install-manifest.txt"
[ -x "$APP_DIR/strata-engine" ] || { say "error: $APP_DIR does not hold a PolyStrata installation"; exit 1; }

# The app's folders, as platformdirs names them on Linux (STRATA_* override them, as in the app).
nonblank() { case "${1:-}" in *[![:space:]]*) printf '%s' "$1" ;; *) printf '%s' "$2" ;; esac; }
DATA_DIR=$(nonblank "${STRATA_DATA_DIR:-}" "$(nonblank "${XDG_DATA_HOME:-}" "$HOME/.local/share")/PolyStrata")
CONFIG_DIR=$(nonblank "${STRATA_CONFIG_DIR:-}" "$(nonblank "${XDG_CONFIG_HOME:-}" "$HOME/.config")/PolyStrata")
CACHE_DIR="$(nonblank "${XDG_CACHE_HOME:-}" "$HOME/.cache")/PolyStrata"
STATE_DIR="$(nonblank "${XDG_STATE_HOME:-}" "$HOME/.local/state")/PolyStrata"

# Remove empty folders upwards from $1, stopping at the home folder, the prefix and the XDG base folders.
prune() {
    d=$1
    while [ -n "$d" ] && [ "$d" != / ] && [ "$d" != "$HOME" ] && [ "$d" != "$PREFIX" ] && [ -d "$d" ]; do
        rmdir "$d" 2>/dev/null || break
        d=$(dirname "$d")
    done
}

if [ -f "$MANIFEST" ]; then
    # The node agent's systemd user service is stopped before its unit file goes.
    if grep -q '/systemd/user/polystrata-node\.service$' "$MANIFEST" && command -v systemctl >/dev/null 2>&1; then
        systemctl --user disable --now polystrata-node.service >/dev/null 2>&1 || true
    fi
    while IFS= read -r path; do
        [ -n "$path" ] || continue
        if [ -L "$path" ] || [ -f "$path" ]; then
            rm -f "$path"
            prune "$(dirname "$path")"
        fi
    done < "$MANIFEST"
    command -v systemctl >/dev/null 2>&1 && systemctl --user daemon-reload >/dev/null 2>&1 || true
fi

rm -rf "$APP_DIR"
prune "$(dirname "$APP_DIR")"
say "removed the program from $APP_DIR"
[ "$PROGRAM_ONLY" = 1 ] && exit 0

rm -rf "$CONFIG_DIR" "$CACHE_DIR" "$STATE_DIR"
prune "$(dirname "$CONFIG_DIR")"
prune "$(dirname "$CACHE_DIR")"
prune "$(dirname "$STATE_DIR")"

MODELS="$DATA_DIR/models"
if [ "$REMOVE_MODELS" = ask ]; then
    REMOVE_MODELS=0
    if [ "$ASK" = 1 ] && [ -d "$MODELS" ] && [ -n "$(ls -A "$MODELS" 2>/dev/null)" ]; then
        printf 'Also delete the downloaded models in %s (%s)? [y/N] ' "$MODELS" "$(du -sh "$MODELS" | cut -f1)"
        read -r answer || answer=
        case "$answer" in y|Y|yes|YES|Yes) REMOVE_MODELS=1 ;; esac
    fi
fi
if [ -d "$DATA_DIR" ]; then
    for entry in "$DATA_DIR"/* "$DATA_DIR"/.[!.]* "$DATA_DIR"/..?*; do
        [ -e "$entry" ] || [ -L "$entry" ] || continue
        [ "$entry" = "$MODELS" ] && [ "$REMOVE_MODELS" = 0 ] && continue
        rm -rf "$entry"
    done
    prune "$DATA_DIR"
fi
if [ -d "$MODELS" ]; then
    say "removed PolyStrata's settings and data; kept the models in $MODELS (delete that folder to free the space)"
else
    say "removed PolyStrata's settings, data and models"
fi
