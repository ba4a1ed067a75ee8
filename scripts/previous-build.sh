#!/usr/bin/env bash
# The binaries of the build the upgrade check upgrades from (packaging/previous-release names
# its commit), built once from that commit's own sources and kept in
# ~/.cache/shepherd/previous/COMMIT/ as cargo lays out a `dev` build (debug/shepherd,
# debug/shepherd-agent); package.sh versions them by SHEPHERD_VERSION_COMMIT=COMMIT. Prints
# that directory. The build takes about ten minutes on 2 cores; its target
# directory is removed once the binaries are copied.
#
# Usage: scripts/previous-build.sh
set -euo pipefail
cd "$(dirname "$0")/.."
commit=$(grep -v '^#' packaging/previous-release | head -1)
[ -n "$commit" ] || { echo "previous-build: packaging/previous-release names no commit" >&2; exit 1; }
cache="${SHEPHERD_PREVIOUS_DIR:-$HOME/.cache/shepherd/previous}/$commit"
if [ -x "$cache/debug/shepherd" ] && [ -x "$cache/debug/shepherd-agent" ]; then
  echo "$cache"
  exit 0
fi
if ! git cat-file -e "$commit^{commit}" 2>/dev/null; then
  echo "previous-build: commit $commit is not in this clone's history (a shallow clone?); fetch it or build it elsewhere into $cache" >&2
  exit 1
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git archive "$commit" | tar -x -C "$work"
echo "previous-build: building $commit, once" >&2
(cd "$work" && CARGO_TARGET_DIR="$work/target" CARGO_INCREMENTAL=0 \
  cargo build --quiet --locked -p shepherd -p shepherd-agent --bins) >&2
mkdir -p "$cache.partial/debug"
cp "$work/target/debug/shepherd" "$work/target/debug/shepherd-agent" "$cache.partial/debug/"
rm -rf "$cache"
mv "$cache.partial" "$cache"
echo "$cache"
