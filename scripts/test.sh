#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite under 4 MPI ranks:
#   mpiexec -n 4 python -m mpi4py -m pytest
# `python -m mpi4py` turns an exception on one rank into MPI_Abort instead of a deadlock.
# tests/conftest.py: a test that fails on some ranks only is reported by rank 0 (with that rank's
# traceback), or, if the other ranks are stuck in a collective, the failing rank prints its failure
# and aborts the job after HPCASYNC_TEST_AGREE_TIMEOUT s (default 5); a test still running after
# HPCASYNC_TEST_TIMEOUT_PER_TEST s (default pytest.ini's 600) dumps its stacks on every rank and
# aborts the job.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k ssgd`.
# HPCASYNC_MPI=mpich runs the suite under MPICH instead (its own venv, .venv-mpich; see setup.sh):
# the launcher is MPICH's (no --oversubscribe), Horovod is not there, the ULFM tests skip.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=$(bash "$repo/scripts/setup.sh" | tail -n 1) || exit 1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_mpi_yield_when_idle=1      # ranks waiting in MPI yield the core (4 ranks, 2 cores)
export OMPI_MCA_osc=${OMPI_MCA_osc:-^ucx}  # one host: no UCX one-sided component (it prints errors without UCX hardware)
export PYTHONUNBUFFERED=1
if [ "${HPCASYNC_MPI:-openmpi}" = mpich ]; then export HPCASYNC_HOROVOD=0; fi   # never built there
cd "$repo"
# the launcher of the venv's MPI (hpcasync.launch): line 1 names the MPI, then one argument a line
mapfile -t launch < <("$venv/bin/python" -m hpcasync.launch -n 4)
[ "${#launch[@]}" -gt 1 ] || { echo "test.sh: no MPI launcher for $venv"; exit 1; }
echo "test.sh: ${launch[0]}: ${launch[*]:1}" >&2
timeout "${HPCASYNC_TEST_TIMEOUT:-3600}" "${launch[@]:1}" \
    "$venv/bin/python" -m mpi4py -m pytest "$@"
rc=$?
[ $rc = 5 ] && { echo "no tests collected"; exit 1; }
exit $rc
