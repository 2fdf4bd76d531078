# Shared part of the hpcasync sbatch templates (sourced, not run). It finds Python and mpirun,
# names the metrics file after the job, launches `hpcasync train` (or your SCRIPT) with srun or
# mpirun, forwards the preemption warning to the ranks, and requeues the job when training
# stopped for preemption.
#
# Inputs (environment; every one optional):
#   HPCASYNC_PYTHON   the Python to run (default: $HPCASYNC_VENV/bin/python, else the repo's
#                     .venv/bin/python, else python3 on PATH)
#   HPCASYNC_VENV     a virtual environment holding hpcasync, torch, mpi4py (and Open MPI or MPICH)
#   HPCASYNC_REPO     the hpcasync checkout, put on PYTHONPATH (default: the submit directory)
#   LAUNCHER          srun (default: `srun --mpi=pmix`; `--mpi=pmi2` under MPICH) or mpirun (the one
#                     next to Python: Open MPI's gets --oversubscribe, MPICH's hydra needs nothing)
#   ALGORITHM EPOCHS DATASET MODEL      the usual training options
#   EXTRA_ARGS        more `hpcasync train` options (split on spaces); script arguments also go there
#   RUN_DIR           where metrics go (default: $SLURM_SUBMIT_DIR/runs)
#   METRICS           the metrics file (default: $RUN_DIR/hpcasync-$SLURM_JOB_ID.jsonl)
#   CHECKPOINT_DIR    enables checkpoints: --checkpoint-dir DIR --resume auto
#   REQUEUE           1 (default): requeue the job when training exits with status 75 (preempted)
#   MAX_RESTARTS      N > 0: `hpcasync launch --max-restarts N` runs the training and, after a
#                     rank's death, starts it again from the newest checkpoint (a new srun step in
#                     the allocation, or a new mpirun); needs CHECKPOINT_DIR (not with SCRIPT)
#   SCRIPT            your own training script instead of `hpcasync train`: EXTRA_ARGS and the
#                     arguments after the template go to it (not the training options above; it
#                     resumes from its own checkpoints, e.g. `hpcasync.elastic.State.persist`)
# shellcheck shell=bash

hpc_say() { echo "hpcasync-sbatch: $*" >&2; }
hpc_die() { hpc_say "error: $*"; exit 1; }

# Status with which `hpcasync train` reports "stopped at a checkpoint because of a preemption
# signal" (EX_TEMPFAIL, hpcasync.checkpoint.EXIT_PREEMPTED).
HPC_EXIT_PREEMPTED=75

hpc_setup() {
    HPCASYNC_REPO=${HPCASYNC_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}
    if [ -z "${HPCASYNC_PYTHON:-}" ]; then
        if [ -n "${HPCASYNC_VENV:-}" ]; then HPCASYNC_PYTHON=$HPCASYNC_VENV/bin/python
        elif [ -x "$HPCASYNC_REPO/.venv/bin/python" ]; then HPCASYNC_PYTHON=$HPCASYNC_REPO/.venv/bin/python
        else HPCASYNC_PYTHON=$(command -v python3 || true)
        fi
    fi
    [ -x "$HPCASYNC_PYTHON" ] || hpc_die "no Python at '$HPCASYNC_PYTHON' (set HPCASYNC_PYTHON or HPCASYNC_VENV)"
    export PYTHONPATH=$HPCASYNC_REPO${PYTHONPATH:+:$PYTHONPATH}
    # find_spec, not import: importing torch costs seconds on every job start
    local missing
    missing=$("$HPCASYNC_PYTHON" -c 'import importlib.util as u
print(" ".join(m for m in ("hpcasync", "mpi4py", "torch") if u.find_spec(m) is None))') \
        || hpc_die "$HPCASYNC_PYTHON does not run"
    [ -z "$missing" ] || hpc_die "$HPCASYNC_PYTHON cannot import: $missing (HPCASYNC_REPO=$HPCASYNC_REPO)"
    # which MPI mpi4py loads (hpcasync.launch; MPI is not started by asking): openmpi or mpich
    HPC_MPI=$("$HPCASYNC_PYTHON" -m hpcasync.launch --vendor) || hpc_die "$HPCASYNC_PYTHON: no usable MPI"
    HPC_BIN=$(dirname "$HPCASYNC_PYTHON")
    LAUNCHER=${LAUNCHER:-srun}
    case $LAUNCHER in srun|mpirun) ;; *) hpc_die "LAUNCHER must be srun or mpirun, not '$LAUNCHER'";; esac
    if [ -z "${SLURM_JOB_ID:-}" ]; then LAUNCHER=mpirun; fi   # run outside Slurm: plain mpirun
    # Open MPI 5's own PMIx has no munge security module; Slurm's PMIx server offers "munge,native".
    export PMIX_MCA_psec=${PMIX_MCA_psec:-native}
    # More ranks than cores on this node (a laptop or a one-box test cluster): ranks waiting in MPI
    # must yield the core instead of spinning.
    local cores; cores=$(nproc)
    if [ "${SLURM_CPUS_ON_NODE:-0}" -gt "$cores" ] || [ "${SLURM_NTASKS_PER_NODE:-0}" -gt "$cores" ]; then
        export OMPI_MCA_mpi_yield_when_idle=1
    fi
    local jobid=${SLURM_JOB_ID:-local-$(date +%Y%m%d-%H%M%S)}
    local restart=""
    if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then restart="-r$SLURM_RESTART_COUNT"; fi
    RUN_DIR=${RUN_DIR:-${SLURM_SUBMIT_DIR:-$PWD}/runs}
    METRICS=${METRICS:-$RUN_DIR/hpcasync-$jobid$restart.jsonl}
    mkdir -p "$RUN_DIR" "$(dirname "$METRICS")" || hpc_die "cannot create $RUN_DIR"
    if [ -n "${SCRIPT:-}" ]; then           # your own script: only its own arguments
        [ -f "$SCRIPT" ] || hpc_die "SCRIPT=$SCRIPT: no such file"
        TRAIN_ARGS=()
    else
        TRAIN_ARGS=(--algorithm "${ALGORITHM:-ssgd}" --epochs "${EPOCHS:-2}"
                    --dataset "${DATASET:-fashion-mnist}" --model "${MODEL:-lenet}"
                    --metrics "$METRICS")
        if [ -n "${CHECKPOINT_DIR:-}" ]; then
            mkdir -p "$CHECKPOINT_DIR" || hpc_die "cannot create $CHECKPOINT_DIR"
            TRAIN_ARGS+=(--checkpoint-dir "$CHECKPOINT_DIR" --resume auto)
        fi
    fi
    # shellcheck disable=SC2206
    if [ -n "${EXTRA_ARGS:-}" ]; then TRAIN_ARGS+=($EXTRA_ARGS); fi
}

# hpc_launch NPROCS [ARGS...]: run `hpcasync train` (or SCRIPT) on NPROCS ranks; returns its status
# (call it as `rc=0; hpc_launch ... || rc=$?` under set -e).
hpc_launch() {
    local np=$1; shift
    local cmd
    if [ "${MAX_RESTARTS:-0}" -gt 0 ]; then
        # the supervisor starts each attempt itself (python -m hpcasync.cli launch --help)
        [ -n "${CHECKPOINT_DIR:-}" ] || [ -n "${SCRIPT:-}" ] \
            || hpc_die "MAX_RESTARTS needs CHECKPOINT_DIR (a restart resumes from it)"
        if [ "$(id -u)" = 0 ] && [ "$HPC_MPI" = openmpi ]; then
            export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
        fi
        local how=srun
        if [ "$LAUNCHER" = mpirun ]; then how=mpiexec; fi
        cmd=("$HPCASYNC_PYTHON" -m hpcasync.cli launch -n "$np" --launcher "$how"
             --max-restarts "$MAX_RESTARTS" -- "${SCRIPT:-train}")
    elif [ "$LAUNCHER" = srun ]; then
        # --mpi=pmix is essential: Open MPI 5 started by srun without PMIx comes up as NPROCS
        # separate jobs of size 1 (hpcasync detects it and stops with an error). MPICH speaks PMI-2.
        local pmi=pmix
        if [ "$HPC_MPI" = mpich ]; then pmi=pmi2; fi
        cmd=(srun --mpi=$pmi --kill-on-bad-exit=1 --ntasks="$np")
    else
        local mpirun=$HPC_BIN/mpirun out
        [ -x "$mpirun" ] || mpirun=$(command -v mpirun) || hpc_die "no mpirun next to $HPCASYNC_PYTHON or on PATH"
        # the launcher's options for this MPI (hpcasync.launch): line 1 the MPI, then the argv
        out=$("$HPCASYNC_PYTHON" -m hpcasync.launch -n "$np" --mpiexec "$mpirun") || hpc_die "cannot launch with $mpirun"
        mapfile -t cmd <<< "$out"
        cmd=("${cmd[@]:1}")
        if [ "$(id -u)" = 0 ] && [ "$HPC_MPI" = openmpi ]; then cmd+=(--allow-run-as-root); fi
    fi
    if [ "${MAX_RESTARTS:-0}" -gt 0 ]; then cmd+=("${TRAIN_ARGS[@]}" "$@")
    elif [ -n "${SCRIPT:-}" ]; then cmd+=("$HPCASYNC_PYTHON" "$SCRIPT" "${TRAIN_ARGS[@]}" "$@")
    else cmd+=("$HPCASYNC_PYTHON" -m hpcasync.cli train "${TRAIN_ARGS[@]}" "$@")
    fi
    hpc_say "job ${SLURM_JOB_ID:-(none)} on ${SLURM_JOB_NODELIST:-$(hostname)}: ${cmd[*]}"
    hpc_say "metrics: $METRICS"
    # The launcher runs in the background so this shell can take the preemption warning
    # (#SBATCH --signal=B:USR1@60) and pass it on: srun forwards it to every task, mpirun to every
    # rank. The batch shell itself is not a job step, so `--signal=USR1@60` without B: would reach
    # srun's tasks but never ranks started by mpirun.
    "${cmd[@]}" &
    HPC_LAUNCHER_PID=$!
    trap 'hpc_say "preemption warning: passing SIGUSR1 to the ranks"; kill -USR1 "$HPC_LAUNCHER_PID" 2>/dev/null' USR1
    trap 'kill -TERM "$HPC_LAUNCHER_PID" 2>/dev/null' TERM
    local rc
    while :; do
        rc=0; wait "$HPC_LAUNCHER_PID" || rc=$?
        # wait returns >128 when a trapped signal interrupts it; the launcher is still running.
        if [ "$rc" -gt 128 ] && kill -0 "$HPC_LAUNCHER_PID" 2>/dev/null; then continue; fi
        break
    done
    trap - USR1 TERM
    return "$rc"
}

# hpc_finish STATUS: requeue on a preemption stop (when allowed), else exit with STATUS.
hpc_finish() {
    local rc=$1
    if [ "$rc" = "$HPC_EXIT_PREEMPTED" ]; then
        if [ "${REQUEUE:-1}" = 1 ] && [ -n "${SLURM_JOB_ID:-}" ] && [ -n "${CHECKPOINT_DIR:-}" ]; then
            hpc_say "training stopped for preemption at a checkpoint: requeueing job $SLURM_JOB_ID"
            scontrol requeue "$SLURM_JOB_ID" || hpc_die "scontrol requeue $SLURM_JOB_ID failed"
            exit 0
        fi
        hpc_say "training stopped for preemption; resubmit with the same CHECKPOINT_DIR to resume"
    elif [ "$rc" != 0 ]; then
        hpc_say "training failed with status $rc"
    fi
    exit "$rc"
}
