#!/usr/bin/env bash
# Fetch Horovod's own PyTorch examples (tag v0.28.1) for tests/mpi/test_horovod_examples.py, which runs
# them unchanged but for their `import horovod...` lines, under real Horovod and under
# hpcasync.horovod. They are not in Horovod's sdist and are not committed here (Horovod's files);
# they go to .cache/horovod-examples/ (git-ignored). Needs access to github.com; without it the
# tests skip and say how to get the files (e.g. copy them there from a Horovod checkout).
#
# Usage: bash scripts/fetch-horovod-examples.sh [DEST]
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.cache/horovod-examples}
mkdir -p "$dest"
base=https://raw.githubusercontent.com/horovod/horovod/v0.28.1/examples/pytorch
for f in pytorch_mnist.py pytorch_synthetic_benchmark.py; do
    curl -fsSL --max-time 60 "$base/$f" -o "$dest/$f.tmp" && mv "$dest/$f.tmp" "$dest/$f" || {
        rm -f "$dest/$f.tmp"; echo "fetch-horovod-examples: cannot download $base/$f" >&2; exit 1; }
done
echo "fetch-horovod-examples: $(ls "$dest" | tr '\n' ' ')in $dest"
