#!/bin/sh
# PolyStrata @VERSION@ (@FLAVOUR@) for Linux: a self-extracting installer. Double-click it (or run it) to install
# PolyStrata for yourself into ~/.local, with a menu entry. From a terminal:
#   sh @NAME@.run                     install; asks whether PolyStrata should start when you log in
#   sh @NAME@.run --prefix DIR        install into DIR instead of ~/.local
#   sh @NAME@.run --extract DIR       only unpack (DIR/@NAME@/install.sh installs from there)
#   sh @NAME@.run --check             only verify the file
# Other options go to the installer: --autostart, --autostart-node (start the app / the node agent at log-in),
#   --no-desktop (no menu entry), --yes (ask nothing), --launch / --no-launch (open the app when done).
set -eu
OFFSET=@OFFSET@
SHA256=@SHA256@
NAME=@NAME@
NEED_KB=@SIZE_KB@

say() { printf '[polystrata] %s\n' "$*"; }
die() { printf '[polystrata] error: %s\n' "$*" >&2; exit 1; }
payload() { tail -c +$((OFFSET + 1)) "$0"; }

check() {
    if command -v sha256sum >/dev/null 2>&1; then
        got=$(payload | sha256sum | cut -d' ' -f1)
        [ "$got" = "$SHA256" ] || die "$0 is damaged (sha256 $got, expected $SHA256): download it again"
    fi
}

MODE=install
EXTRACT_TO=
PREFIX="${HOME:?HOME is not set}/.local"
PASS=
while [ $# -gt 0 ]; do
    case "$1" in
        --extract) [ $# -ge 2 ] || die "--extract needs a folder"; MODE=extract; EXTRACT_TO=$2; shift ;;
        --check) MODE=check ;;
        --prefix) [ $# -ge 2 ] || die "--prefix needs a folder"; PREFIX=$2; shift ;;
        --prefix=*) PREFIX=${1#--prefix=} ;;
        -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) PASS="$PASS $(printf '%s' "$1" | sed "s/'/'\\\\''/g; s/^/'/; s/\$/'/")" ;;
    esac
    shift
done

check
case "$MODE" in
    check) say "$0 is intact (PolyStrata @VERSION@, @FLAVOUR@)"; exit 0 ;;
    extract)
        mkdir -p "$EXTRACT_TO"
        payload | tar -xzf - -C "$EXTRACT_TO"
        say "unpacked into $EXTRACT_TO/$NAME: run $EXTRACT_TO/$NAME/install.sh to install"
        exit 0 ;;
esac

case "$PREFIX" in /*) ;; *) PREFIX="$(pwd)/$PREFIX" ;; esac
mkdir -p "$PREFIX/lib" || die "cannot create $PREFIX/lib: choose a folder you can write with --prefix"
free_kb=$(df -Pk "$PREFIX/lib" | awk 'NR == 2 {print $4}')
[ -z "$free_kb" ] || [ "$free_kb" -ge "$NEED_KB" ] ||
    die "PolyStrata needs $((NEED_KB / 1024)) MB in $PREFIX and only $((free_kb / 1024)) MB are free: free some space or choose another --prefix"
# Unpacked next to its destination, so that install.sh moves the program into place instead of copying it.
STAGE=$(mktemp -d "$PREFIX/lib/.polystrata-stage.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
say "unpacking PolyStrata @VERSION@ (@FLAVOUR@)"
payload | tar -xzf - -C "$STAGE"
eval "set -- $PASS"
sh "$STAGE/$NAME/install.sh" --move --prefix "$PREFIX" "$@"
exit 0
