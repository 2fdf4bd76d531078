#!/usr/bin/env bash
# The main job from scratch: set up (scripts/setup.sh), then train LeNet on Fashion-MNIST with
# synchronous SGD on 4 MPI ranks, showing progress and the final test accuracy.
# Override any option: bash scripts/run-main.sh --algorithm daso --ranks-per-node 2 --epochs 4
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=$(bash "$repo/scripts/setup.sh" | tail -n 1)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
export OMPI_MCA_btl=${OMPI_MCA_btl:-^ofi}   # one host: skip libfabric's 1 s probe in MPI_Init
mkdir -p "$repo/runs"
cd "$repo"
# the launcher of the venv's MPI (hpcasync.launch): line 1 names the MPI, then one argument a line
# (Open MPI: mpiexec --oversubscribe -n N; MPICH's hydra: mpiexec -n N)
mapfile -t launch < <(PATH="$venv/bin:$PATH" "$venv/bin/python" -m hpcasync.launch -n "${NP:-4}")
[ "${#launch[@]}" -gt 1 ] || { echo "run-main: no MPI launcher in $venv" >&2; exit 1; }
exec "${launch[@]:1}" "$venv/bin/hpcasync" train \
    --algorithm ssgd --dataset fashion-mnist --model lenet --epochs 2 \
    --metrics runs/main.jsonl --progress on "$@"
