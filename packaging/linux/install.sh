#!/bin/sh
# PolyStrata for Linux: install the bundle that sits beside this script, for this user (no root needed).
#   ./install.sh                      install into ~/.local, with a menu entry; asks about autostart on a terminal
#   ./install.sh --prefix DIR         install into DIR (DIR/lib/polystrata, DIR/bin)
#   ./install.sh --autostart          also start the app when you log in
#   ./install.sh --autostart-node     also start the node agent when you log in (lends this PC's GPUs)
#   ./install.sh --no-desktop         no menu entry or icons (headless PCs)
#   ./install.sh --yes                ask nothing; --launch / --no-launch: open the app when done (default: only
#                                     when started without a terminal from a desktop, i.e. by a double-click)
# Uninstall with `strata-uninstall` (DIR/bin) or DIR/lib/polystrata/uninstall.sh: it keeps downloaded models.
set -eu

say() { printf '[polystrata] %s\n' "$*"; }
die() { printf '[polystrata] error: %s\n' "$*" >&2; exit 1; }

HERE=$(cd "$(dirname "$0")" && pwd)
BUNDLE="$HERE/PolyStrata"
PREFIX="${HOME:?HOME is not set}/.local"
AUTOSTART=ask
AUTOSTART_NODE=ask
DESKTOP=1
LAUNCH=auto
MOVE=0
ASK=1
[ -t 0 ] && [ -t 1 ] || ASK=0

while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) [ $# -ge 2 ] || die "--prefix needs a folder"; PREFIX=$2; shift ;;
        --prefix=*) PREFIX=${1#--prefix=} ;;
        --autostart) AUTOSTART=1 ;;
        --no-autostart) AUTOSTART=0 ;;
        --autostart-node) AUTOSTART_NODE=1 ;;
        --no-autostart-node) AUTOSTART_NODE=0 ;;
        --no-desktop) DESKTOP=0 ;;
        --launch) LAUNCH=1 ;;
        --no-launch) LAUNCH=0 ;;
        --yes|-y) ASK=0 ;;
        --move) MOVE=1 ;;  # used by the self-extracting installer: the bundle is a fresh copy, move it into place
        -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
    shift
done

[ -x "$BUNDLE/strata" ] && [ -x "$BUNDLE/strata-engine" ] ||
    die "no PolyStrata bundle in $BUNDLE (expected the executables strata and strata-engine there): unpack the whole archive and run install.sh from it"
case "$PREFIX" in /*) ;; *) PREFIX="$(pwd)/$PREFIX" ;; esac

DATA_HOME=${XDG_DATA_HOME:-$HOME/.local/share}
CONFIG_HOME=${XDG_CONFIG_HOME:-$HOME/.config}
APP_DIR="$PREFIX/lib/polystrata"
BIN_DIR="$PREFIX/bin"
MANIFEST="$APP_DIR/install-manifest.txt"

ask_yes() {  # question; answers "no" unless the user types y
    printf '%s [y/N] ' "$1"
    read -r answer || answer=
    case "$answer" in y|Y|yes|YES|Yes) return 0 ;; *) return 1 ;; esac
}

node_can_serve() { "$1/strata-node" serve --help >/dev/null 2>&1; }

# Reinstalling without a terminal keeps the autostart choices of the installation it replaces.
if [ "$ASK" = 0 ] && [ -f "$MANIFEST" ]; then
    [ "$AUTOSTART" != ask ] || ! grep -q '/autostart/polystrata\.desktop$' "$MANIFEST" || AUTOSTART=1
    [ "$AUTOSTART_NODE" != ask ] || ! grep -q 'polystrata-node\.' "$MANIFEST" || AUTOSTART_NODE=1
fi
if [ "$ASK" = 1 ]; then
    say "PolyStrata $(cat "$HERE/VERSION" 2>/dev/null || echo '') will be installed into $APP_DIR"
    if [ "$AUTOSTART" = ask ]; then
        if ask_yes "Start PolyStrata (the tray app and its API server) when you log in?"; then AUTOSTART=1; else AUTOSTART=0; fi
    fi
    if [ "$AUTOSTART_NODE" = ask ] && node_can_serve "$BUNDLE"; then
        if ask_yes "Start the node agent when you log in, so that another PC can use this PC's GPUs?"; then
            AUTOSTART_NODE=1
        else
            AUTOSTART_NODE=0
        fi
    fi
fi
[ "$AUTOSTART" = 1 ] || AUTOSTART=0
[ "$AUTOSTART_NODE" = 1 ] || AUTOSTART_NODE=0

mkdir -p "$PREFIX/lib" "$BIN_DIR" || die "cannot create $PREFIX/lib and $BIN_DIR: choose a folder you can write with --prefix"

[ -f "$APP_DIR/uninstall.sh" ] || [ ! -e "$APP_DIR" ] ||
    die "$APP_DIR exists but is not a PolyStrata installation: move it away or choose another --prefix"

NEW="$PREFIX/lib/.polystrata-new.$$"
trap 'rm -rf "$NEW"' EXIT
if [ "$MOVE" = 1 ]; then
    mv "$BUNDLE" "$NEW"
else
    say "copying the program ($(du -sh "$BUNDLE" | cut -f1)) into $APP_DIR"
    cp -R "$BUNDLE" "$NEW"
fi
cp "$HERE/uninstall.sh" "$NEW/uninstall.sh"
chmod 755 "$NEW/uninstall.sh"
[ -f "$HERE/VERSION" ] && cp "$HERE/VERSION" "$NEW/VERSION"

# An earlier installation here is replaced once the new one is in place beside it (its uninstaller removes the
# program and its desktop files; data and models stay).
if [ -f "$APP_DIR/uninstall.sh" ]; then
    say "replacing the PolyStrata installed in $APP_DIR"
    sh "$APP_DIR/uninstall.sh" --program-only --yes >/dev/null || die "could not remove the earlier installation in $APP_DIR"
fi
mv "$NEW" "$APP_DIR"
trap - EXIT

: > "$MANIFEST"
record() { printf '%s\n' "$1" >> "$MANIFEST"; }

mkdir -p "$BIN_DIR"  # again: the replaced installation's uninstaller removes it when it is left empty
for exe in strata strata-engine strata-node strata-setup; do
    [ -x "$APP_DIR/$exe" ] || continue
    ln -sfn "$APP_DIR/$exe" "$BIN_DIR/$exe"
    record "$BIN_DIR/$exe"
done
ln -sfn "$APP_DIR/uninstall.sh" "$BIN_DIR/strata-uninstall"
record "$BIN_DIR/strata-uninstall"

# A desktop-entry Exec argument (Desktop Entry spec): the path in double quotes with ", `, $ and \ escaped, then
# every backslash doubled once more for the string-value escaping that is applied before the quoting.
exec_quote() { printf '"%s"' "$(printf '%s' "$1" | sed 's/[\\"`$]/\\&/g')" | sed 's/\\/\\\\/g'; }
# A systemd ExecStart argument: double quotes with \ and " escaped; $ and % doubled (variables and specifiers).
unit_quote() { printf '"%s"' "$(printf '%s' "$1" | sed 's/[\\"]/\\&/g; s/\$/$$/g; s/%/%%/g')"; }

write_entry() {  # file, name, comment, exec line, extra lines (printf, not echo: dash's echo eats backslashes)
    mkdir -p "$(dirname "$1")"
    printf '[Desktop Entry]\nType=Application\nVersion=1.4\nName=%s\nComment=%s\nExec=%s\nIcon=polystrata\nTerminal=false\n' \
        "$2" "$3" "$4" > "$1"
    [ -z "${5:-}" ] || printf '%s\n' "$5" >> "$1"
    record "$1"
}

if [ "$DESKTOP" = 1 ]; then
    for size in 16 24 32 48 64 128 256 512; do
        [ -f "$HERE/icons/polystrata-$size.png" ] || continue
        dest="$DATA_HOME/icons/hicolor/${size}x${size}/apps/polystrata.png"
        mkdir -p "$(dirname "$dest")"
        cp "$HERE/icons/polystrata-$size.png" "$dest"
        record "$dest"
    done
    if [ -f "$HERE/icons/polystrata.svg" ]; then
        dest="$DATA_HOME/icons/hicolor/scalable/apps/polystrata.svg"
        mkdir -p "$(dirname "$dest")"
        cp "$HERE/icons/polystrata.svg" "$dest"
        record "$dest"
    fi
    write_entry "$DATA_HOME/applications/polystrata.desktop" "PolyStrata" \
        "Run large Mixture-of-Experts models on your NVIDIA cards, with a local OpenAI-compatible API" \
        "$(exec_quote "$APP_DIR/strata")" \
        "GenericName=Local LLM server
Categories=Science;ArtificialIntelligence;
Keywords=LLM;AI;GGUF;MoE;chat;OpenAI;
StartupNotify=true"
fi

if [ "$AUTOSTART" = 1 ]; then
    write_entry "$CONFIG_HOME/autostart/polystrata.desktop" "PolyStrata" "PolyStrata tray app and API server" \
        "$(exec_quote "$APP_DIR/strata")" "X-GNOME-Autostart-enabled=true"
    say "PolyStrata will start when you log in"
fi

if [ "$AUTOSTART_NODE" = 1 ]; then
    if ! node_can_serve "$APP_DIR"; then
        say "the node agent in this version (strata-node) has no serve command yet, so it cannot start at log-in; nothing set up for it"
    elif command -v systemctl >/dev/null 2>&1 && systemctl --user show-environment >/dev/null 2>&1; then
        unit="$CONFIG_HOME/systemd/user/polystrata-node.service"
        mkdir -p "$(dirname "$unit")"
        cat > "$unit" <<EOF
[Unit]
Description=PolyStrata node agent (lends this PC's GPUs to a PolyStrata main PC)
After=network-online.target

[Service]
ExecStart=$(unit_quote "$APP_DIR/strata-node") serve
Restart=on-failure
RestartSec=5

[Install]
WantedBy=default.target
EOF
        record "$unit"
        systemctl --user daemon-reload && systemctl --user enable --now polystrata-node.service >/dev/null 2>&1 ||
            say "could not enable polystrata-node.service: run systemctl --user enable --now polystrata-node.service"
        say "the node agent runs as the systemd user service polystrata-node (for PCs without a login: loginctl enable-linger $(id -un))"
    else
        write_entry "$CONFIG_HOME/autostart/polystrata-node.desktop" "PolyStrata node agent" \
            "Lends this PC's GPUs to a PolyStrata main PC" "$(exec_quote "$APP_DIR/strata-node") serve" "NoDisplay=true"
        say "the node agent will start when you log in"
    fi
fi

say "installed PolyStrata into $APP_DIR"
case ":${PATH:-}:" in
    *":$BIN_DIR:"*) say "commands: strata, strata-engine, strata-node, strata-setup, strata-uninstall" ;;
    *) say "commands are in $BIN_DIR (not on your PATH: add it, or log out and in again if it was just created)" ;;
esac
[ "$DESKTOP" = 1 ] && say "PolyStrata is in your applications menu"

# Can the window open here? Qt's X11 plugin needs system libraries a minimal desktop may lack: say which, and the
# command that installs them (shown in a dialog too where the installer was double-clicked).
if [ "$DESKTOP" = 1 ] && [ -n "${DISPLAY:-}" ]; then
    if ! check=$("$APP_DIR/strata" --check-system 2>&1); then
        printf '%s\n' "$check" >&2
        if [ ! -t 1 ]; then
            if command -v zenity >/dev/null 2>&1; then zenity --warning --title PolyStrata --text "$check" || true
            elif command -v kdialog >/dev/null 2>&1; then kdialog --title PolyStrata --sorry "$check" || true
            elif command -v notify-send >/dev/null 2>&1; then notify-send PolyStrata "$check" || true
            fi
        fi
        LAUNCH=0
    fi
fi

if [ "$LAUNCH" = auto ]; then
    LAUNCH=0
    if [ ! -t 0 ] && [ "$DESKTOP" = 1 ] && { [ -n "${DISPLAY:-}" ] || [ -n "${WAYLAND_DISPLAY:-}" ]; }; then LAUNCH=1; fi
fi
if [ "$LAUNCH" = 1 ]; then
    nohup "$APP_DIR/strata" >/dev/null 2>&1 &
fi
exit 0
