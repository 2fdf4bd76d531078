#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite in two passes:
#   1. tests/unit in one process:          python -m pytest tests/unit
#   2. tests/mpi under 4 MPI ranks:        mpiexec -n 4 python -m mpi4py -m pytest tests/mpi
# tests/unit needs no MPI job (rules, schedules, data, models, the simulator); tests/mpi holds every
# test that needs several ranks or launches its own MPI job.
# `python -m mpi4py` turns an exception on one rank into MPI_Abort instead of a deadlock.
# tests/conftest.py: a test that fails on some ranks only is reported by rank 0 (with that rank's
# traceback), or, if the other ranks are stuck in a collective, the failing rank prints its failure
# and aborts the job after HPCASYNC_TEST_AGREE_TIMEOUT s (default 5); a test still running after
# HPCASYNC_TEST_TIMEOUT_PER_TEST s (default pytest.ini's 600) dumps its stacks on every rank and
# aborts the job.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k ssgd`; a test path among them goes to
# the pass it belongs to (`bash scripts/test.sh tests/mpi/test_ssgd.py` runs only the MPI pass).
# HPCASYNC_TEST_PASSES="unit mpi" (the default) picks the passes; "mpi" runs the MPI pass alone.
# "nompi" runs tests/mpi's tests marked no_mpi (they start no MPI job: simulated studies, errors
# raised before MPI_Init) in one process; .ci/run runs it beside the unit pass and leaves them out of
# the MPI pass (-m "not no_mpi"), where rank 0 ran them alone while the other three ranks waited.
# HPCASYNC_TEST_TIMEOUT (s, default 3600) bounds both passes together.
# Exit status: the first failing pass's; "no tests collected" (pytest's 5) is a failure, except for
# a pass that a -k/-m filter or a path of the other pass left empty.
# HPCASYNC_MPI=mpich runs the suite under MPICH instead (its own venv, .venv-mpich; see setup.sh):
# the launcher is MPICH's (no --oversubscribe), Horovod is not there, the ULFM tests skip.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=$(bash "$repo/scripts/setup.sh" | tail -n 1) || exit 1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_mpi_yield_when_idle=1      # ranks waiting in MPI yield the core (4 ranks, 2 cores)
export OMPI_MCA_osc=${OMPI_MCA_osc:-^ucx}  # one host: no UCX one-sided component (it prints errors without UCX hardware)
# One host: no libfabric byte-transfer layer. Its provider probe costs every Open MPI process 1 s of
# MPI_Init on this VM (4 ranks: 1.19 s -> 0.19 s; a singleton 1.10 -> 0.10 s), paid by each of the
# hundreds of jobs the tests start; sm, tcp and self stay (nested jobs keep it: launch.KEEP).
export OMPI_MCA_btl=${OMPI_MCA_btl:-^ofi}
export PYTHONUNBUFFERED=1
# Every Python process of the run (the ranks and the jobs the tests start) imports torch._dynamo
# only when something besides its two eager no-ops is asked of it, torch._meta_registrations
# (Meta-key kernels only) and torch.export only when a name is asked of them
# (tests/site/sitecustomize.py: ~1.7 CPU-s in each process that builds or steps a torch
# optimizer, ~0.8 CPU-s in each that imports torch); HPCASYNC_TEST_REAL_TORCH=1 imports all
# three as torch does. The repo itself stays on the path
# (tests.mpi_util's jobs import tests.*).
export PYTHONPATH="$repo/tests/site:$repo${PYTHONPATH:+:$PYTHONPATH}"
if [ "${HPCASYNC_MPI:-openmpi}" = mpich ]; then export HPCASYNC_HOROVOD=0; fi   # never built there
cd "$repo"
# Byte-compile the package and the tests once. Under PYTHONDONTWRITEBYTECODE=1 (set on the CI box) no
# process writes __pycache__, so in a clean clone every rank of every job the tests start (over 1000
# in a CI run) compiled the hpcasync modules it imports again: ~0.2 CPU-s a rank, 0.7-0.8 CPU-s a
# 4-rank training job. Python never uses a stale .pyc (it checks the source's mtime and size).
"$venv/bin/python" -m compileall -q hpcasync tests >/dev/null 2>&1 || true

# Split the arguments: test paths (tests/unit/..., tests/mpi/..., with or without ::node) go to
# their pass; everything else (options) goes to both.
opts=() unit_paths=() mpi_paths=() filtered=0
for arg in "$@"; do
    case $arg in
        -k|-m|-k*|-m*|--deselect*|--lf|--last-failed) filtered=1 ;;
    esac
    file=${arg%%::*}
    if [ "${arg#-}" = "$arg" ] && [ -e "$file" ]; then
        case $(realpath -m --relative-to="$repo" "$file") in
            tests/unit|tests/unit/*) unit_paths+=("$arg") ;;
            tests|tests/) unit_paths+=(tests/unit); mpi_paths+=(tests/mpi) ;;
            *) mpi_paths+=("$arg") ;;
        esac
    else
        opts+=("$arg")
    fi
done
passes=${HPCASYNC_TEST_PASSES:-unit mpi}
if [ ${#unit_paths[@]} -gt 0 ] || [ ${#mpi_paths[@]} -gt 0 ]; then   # paths name the passes
    filtered=1
    wanted=""
    [ ${#unit_paths[@]} -gt 0 ] && [[ " $passes " == *" unit "* ]] && wanted+=" unit"
    [ ${#mpi_paths[@]} -gt 0 ] && [[ " $passes " == *" mpi "* ]] && wanted+=" mpi"
    passes=$wanted
else
    unit_paths=(tests/unit) mpi_paths=(tests/mpi)
fi
[ -n "${passes// /}" ] || { echo "test.sh: nothing to run (HPCASYNC_TEST_PASSES='${HPCASYNC_TEST_PASSES:-}')"; exit 1; }

deadline=$(( $(date +%s) + ${HPCASYNC_TEST_TIMEOUT:-3600} ))
left() { local s=$(( deadline - $(date +%s) )); echo $(( s > 1 ? s : 1 )); }
rc=0 ran=0 empty=()
for pass in $passes; do
    case $pass in
        unit)
            echo "test.sh: tests/unit in one process" >&2
            timeout "$(left)" "$venv/bin/python" -m pytest "${opts[@]}" "${unit_paths[@]}"
            r=$? ;;
        nompi)
            echo "test.sh: tests/mpi's no_mpi tests in one process" >&2
            timeout "$(left)" "$venv/bin/python" -m pytest "${opts[@]}" -m no_mpi tests/mpi
            r=$? ;;
        mpi)
            # the launcher of the venv's MPI (hpcasync.launch): line 1 names the MPI, then one
            # argument a line
            mapfile -t launch < <("$venv/bin/python" -m hpcasync.launch -n 4)
            [ "${#launch[@]}" -gt 1 ] || { echo "test.sh: no MPI launcher for $venv"; exit 1; }
            echo "test.sh: tests/mpi under ${launch[0]}: ${launch[*]:1}" >&2
            run_mpi() {
                timeout "$(left)" "${launch[@]:1}" \
                    "$venv/bin/python" -m mpi4py -m pytest "${opts[@]}" "$@"
            }
            if [ "${mpi_paths[*]}" = tests/mpi ]; then
                # Two runs, each in fresh processes: tests/mpi/reliability, then the rest. Every
                # reliability test is marked rank0 (it launches its own fault-injection jobs, ~250
                # of them), so that directory runs in one process, a world of 1: under mpiexec -n 4
                # the other three ranks only waited, polling, and four pytest processes started
                # and collected (~5 % of the pass). In two CI runs of one job for both, rank 0
                # died of SIGSEGV inside MPI_Bcast in the first test after that directory
                # (tests/mpi/test_api.py, the first to use COMM_WORLD in-process; cause not found,
                # not reproduced alone); a crash in one no longer takes the other's results.
                echo "test.sh: tests/mpi/reliability in one process (every test there is rank0)" >&2
                timeout "$(left)" "$venv/bin/python" -m mpi4py -m pytest "${opts[@]}" \
                    tests/mpi/reliability
                r1=$?
                run_mpi tests/mpi --ignore=tests/mpi/reliability
                r2=$?
                if [ $r1 = 5 ] && [ $r2 = 5 ]; then r=5
                elif [ $r1 != 0 ] && [ $r1 != 5 ]; then r=$r1
                elif [ $r2 != 0 ] && [ $r2 != 5 ]; then r=$r2
                else r=0; fi
            else
                run_mpi "${mpi_paths[@]}"
                r=$?
            fi ;;
        *) echo "test.sh: unknown pass '$pass' in HPCASYNC_TEST_PASSES (unit, mpi, nompi)"; exit 1 ;;
    esac
    echo "test.sh: $pass pass exit $r" >&2
    if [ $r = 5 ]; then empty+=("$pass"); continue; fi
    ran=1
    [ $rc = 0 ] && rc=$r
done
if [ ${#empty[@]} -gt 0 ] && { [ $filtered = 0 ] || [ $ran = 0 ]; }; then
    echo "no tests collected (${empty[*]} pass)"
    exit 1
fi
exit $rc
