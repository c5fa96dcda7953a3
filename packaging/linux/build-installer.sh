#!/bin/sh
# Build the Linux installers from a PyInstaller bundle (run `pyinstaller build.spec` first):
#   dist/PolyStrata-<version>-linux-<flavour>.run     self-extracting installer (sh file.run --help)
#   dist/PolyStrata-<version>-linux-<flavour>.tar.gz  the same payload as a tarball: unpack, then ./install.sh
# Usage: packaging/linux/build-installer.sh [--bundle DIR] [--out DIR] [--gzip-level 1-9] [--no-tarball]
# The flavour (cpu or cuda) is read from the bundle: cuda when it holds torch's CUDA library.
set -eu

say() { printf '[build-installer] %s\n' "$*"; }
die() { printf '[build-installer] error: %s\n' "$*" >&2; exit 1; }

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
BUNDLE="$ROOT/dist/PolyStrata"
OUT="$ROOT/dist"
LEVEL=6
TARBALL=1
while [ $# -gt 0 ]; do
    case "$1" in
        --bundle) BUNDLE=$2; shift ;;
        --out) OUT=$2; shift ;;
        --gzip-level) LEVEL=$2; shift ;;
        --no-tarball) TARBALL=0 ;;
        -h|--help) sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
    shift
done
case "$LEVEL" in [1-9]) ;; *) die "--gzip-level must be 1 to 9, not $LEVEL" ;; esac
[ -x "$BUNDLE/strata" ] && [ -x "$BUNDLE/strata-engine" ] ||
    die "no bundle in $BUNDLE (expected strata and strata-engine there): run pyinstaller build.spec first"
BUNDLE=$(cd "$BUNDLE" && pwd)

VERSION=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$ROOT/installer/version.py")
[ -n "$VERSION" ] || die "no __version__ in installer/version.py"
if ls "$BUNDLE"/_internal/torch/lib/libtorch_cuda*.so* >/dev/null 2>&1; then FLAVOUR=cuda; else FLAVOUR=cpu; fi
NAME="PolyStrata-$VERSION-linux-$FLAVOUR"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

# The payload: PolyStrata/ (the bundle), install.sh, uninstall.sh, icons/, VERSION.
STAGE=$(mktemp -d "$OUT/.stage.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
mkdir "$STAGE/$NAME" "$STAGE/$NAME/icons"
ln -s "$BUNDLE" "$STAGE/$NAME/PolyStrata"
cp "$HERE/install.sh" "$HERE/uninstall.sh" "$STAGE/$NAME/"
chmod 755 "$STAGE/$NAME/install.sh" "$STAGE/$NAME/uninstall.sh"
cp "$ROOT"/resources/polystrata.svg "$ROOT"/resources/polystrata-*.png "$STAGE/$NAME/icons/"
echo "$VERSION ($FLAVOUR)" > "$STAGE/$NAME/VERSION"

say "packing $BUNDLE ($(du -sh "$BUNDLE" | cut -f1)) with gzip -$LEVEL"
# -h follows the one link (to the bundle) so that the bundle is packed without copying it first.
tar -C "$STAGE" -chf - "$NAME" | gzip "-$LEVEL" > "$STAGE/payload.tar.gz"
SHA=$(sha256sum "$STAGE/payload.tar.gz" | cut -d' ' -f1)
SIZE=$(du -sk "$BUNDLE" | cut -f1)

# The stub's length must not depend on the offset written into it: the offset is padded with spaces to 12 places.
write_stub() {
    sed -e "s/@VERSION@/$VERSION/g" -e "s/@FLAVOUR@/$FLAVOUR/g" -e "s/@NAME@/$NAME/g" -e "s/@SHA256@/$SHA/g" \
        -e "s/@SIZE_KB@/$SIZE/g" -e "s/@OFFSET@/$(printf '%-12d' "$1")/g" "$HERE/run-stub.sh"
}
write_stub 0 > "$STAGE/stub"
OFFSET=$(wc -c < "$STAGE/stub" | tr -d ' ')
write_stub "$OFFSET" > "$STAGE/stub"
[ "$(wc -c < "$STAGE/stub" | tr -d ' ')" = "$OFFSET" ] || die "the stub's length changed with its offset"
cat "$STAGE/stub" "$STAGE/payload.tar.gz" > "$OUT/$NAME.run"
chmod 755 "$OUT/$NAME.run"
say "wrote $OUT/$NAME.run ($(du -h "$OUT/$NAME.run" | cut -f1))"
if [ "$TARBALL" = 1 ]; then
    mv "$STAGE/payload.tar.gz" "$OUT/$NAME.tar.gz"
    say "wrote $OUT/$NAME.tar.gz"
fi
