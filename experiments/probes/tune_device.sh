#!/usr/bin/env bash
# allreduce auto's fresh-cache decisions (experiments/probes/tune_study.py) on a lent device
# machine's CPUs: idle, a core per rank (16 cores), which the project's 2-core machines cannot give
# 4 ranks. Needs Open MPI and mpi4py as wheels in .whl/ (as gpu_check.sh).
# Usage, in the repo root there:  bash experiments/probes/tune_device.sh OUTDIR [RUNS] [RANKS...]
set -u
out=${1:-/tmp/tune-device}; runs=${2:-10}; shift 2 2>/dev/null || shift $#
ranks=${*:-4}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --prefix /tmp/mpi .whl/*.whl || exit 1
export PATH=/tmp/mpi/bin:$PATH LD_LIBRARY_PATH=/tmp/mpi/lib:${LD_LIBRARY_PATH:-}
export PYTHONPATH=/tmp/mpi/lib/python3.12/site-packages:$PWD
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=^ofi
export OMPI_MCA_osc=^ucx OMPI_MCA_mpi_yield_when_idle=1 PYTHONUNBUFFERED=1
{ date -u; nproc; uptime; python3 -c "import mpi4py.MPI as M; print(M.Get_library_version().splitlines()[0])"; } > "$out/machine.txt" 2>&1
python3 experiments/probes/tune_study.py --runs "$runs" --ranks $ranks \
    --sizes 4K 16K 64K 256K 1M 4M 16M 64M --iters 60 > "$out/tune_study.md" 2> "$out/stderr.txt"
echo "exit $?" >> "$out/machine.txt"; uptime >> "$out/machine.txt"
cat "$out/machine.txt" "$out/tune_study.md"
