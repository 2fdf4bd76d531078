#!/usr/bin/env bash
# A real one-machine Slurm cluster (Debian's slurm-wlm + munge), for trying and testing the sbatch
# templates in slurm/. Runs as root, without systemd; everything Slurm writes lives in STATE_DIR.
#
#   scripts/slurm-cluster.sh start STATE_DIR    install (apt-get) if needed, start munged, slurmctld
#                                               and slurmd, wait until the node is idle; prints
#                                               `export SLURM_CONF=STATE_DIR/slurm.conf` last
#   scripts/slurm-cluster.sh stop STATE_DIR     cancel jobs, `scontrol shutdown`, end the munged this
#                                               script started (by its pid, never by name; left
#                                               running while another cluster's daemons use it)
#   scripts/slurm-cluster.sh status STATE_DIR   sinfo + squeue of that cluster
#
# Both are idempotent: start on a running cluster only reports it, stop on a stopped one does nothing.
# Environment: SLURM_ONEBOX_CPUS (CPUs the node declares, default 8 — more than the cores, so a 4-task
# job fits on a 2-core box), SLURM_ONEBOX_CTLD_PORT / SLURM_ONEBOX_SLURMD_PORT (6817 / 6818),
# SLURM_ONEBOX_WAIT (seconds to wait for the node to come up, default 60), SLURM_ONEBOX_KILL_WAIT
# (KillWait: seconds from a cancelled step's SIGTERM to its SIGKILL, default 2; see write_conf).
# Exit status: 0 done; 3 this machine cannot host a cluster (not root, packages not installable:
# tests skip on it); 1 anything else (the message and the daemons' last log lines say what).
set -euo pipefail

say() { echo "slurm-cluster: $*" >&2; }
die() { say "error: $*"; exit 1; }
# Exit status 3: the environment cannot host a cluster (not root, packages not installable);
# callers such as tests/mpi/test_slurm.py skip on it. Any other failure exits 1.
unavailable() { say "unavailable: $*"; exit 3; }

usage() { echo "usage: $0 start|stop|status STATE_DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
action=$1
mkdir -p "$2" 2>/dev/null || die "cannot create state directory $2"
state=$(cd "$2" && pwd)
conf=$state/slurm.conf

# A launcher's variables (this may be called from inside an mpiexec'd test) must not leak into the
# daemons: they would hand them to every job (Open MPI's, PMIx's, and MPICH hydra's PMI_/HYDI_).
# SLURM_ONEBOX_* are this script's own settings, kept (unset with the rest, the node had 8 CPUs
# and the default ports whatever the caller asked, so the test's jobs ran two at a time).
for v in $(compgen -e); do
    case $v in
        SLURM_ONEBOX_*) ;;
        OMPI_*|PMIX_*|PRTE_*|OPAL_*|SLURM_*|PMI_*|HYDI_*|HYDRA_*|MPIR_*) unset "$v";;
    esac
done
export SLURM_CONF=$conf

need_root() {
    [ "$(id -u)" = 0 ] || unavailable "must run as root (it starts the Slurm daemons and munged)"
}

alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }
pid_of() { [ -s "$1" ] && tr -dc '0-9' < "$1" || true; }

# Wait up to $1 seconds for the command in "${@:2}" to succeed.
wait_for() {
    local limit=$1; shift
    local t=0
    while ! "$@" >/dev/null 2>&1; do
        [ "$t" -ge $((limit * 5)) ] && return 1
        sleep 0.2; t=$((t + 1))
    done
}

# srun --mpi=pmix needs Debian's PMIx (libpmix2) *and* its unversioned libpmix.so (libpmix-dev):
# Slurm's mpi/pmix plugin dlopens .../pmix2/lib/libpmix.so, and slurmd fails every pmix step without it.
PACKAGES="slurm-wlm munge libpmix2 libpmix-dev"
packages_present() {
    command -v slurmctld && command -v slurmd && command -v munged && command -v sbatch \
        && ls /usr/lib/*/pmix2/lib/libpmix.so
}

install_packages() {
    packages_present >/dev/null 2>&1 && return 0
    command -v apt-get >/dev/null || unavailable "$PACKAGES are not installed and there is no apt-get"
    say "installing $PACKAGES (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    # shellcheck disable=SC2086
    if ! timeout 600 apt-get install -y -q $PACKAGES >"$state/apt.log" 2>&1; then
        timeout 300 apt-get update -q >>"$state/apt.log" 2>&1 || true
        timeout 600 apt-get install -y -q $PACKAGES >>"$state/apt.log" 2>&1 || {
            tail -5 "$state/apt.log" >&2
            unavailable "apt-get install $PACKAGES failed (log: $state/apt.log)"; }
    fi
    packages_present >/dev/null 2>&1 \
        || unavailable "$PACKAGES installed, yet slurmctld, munged or libpmix.so is missing"
}

munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
    if munge_ok; then
        say "munged already running: using it (this cluster will not stop it)"
        return 0
    fi
    [ -f /etc/munge/munge.key ] || die "/etc/munge/munge.key is missing (reinstall the munge package)"
    id munge >/dev/null 2>&1 || die "there is no munge user (reinstall the munge package)"
    local d
    for d in /run/munge /var/lib/munge /var/log/munge; do
        mkdir -p "$d"; chown munge:munge "$d"
    done
    chmod 0755 /run/munge
    # A stale pid file from a dead munged makes the new one refuse to start.
    local old; old=$(pid_of /run/munge/munged.pid)
    alive "$old" || rm -f /run/munge/munged.pid /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock
    su -s /bin/sh munge -c munged >"$state/munged.start.log" 2>&1 \
        || { cat "$state/munged.start.log" >&2; die "munged did not start (see /var/log/munge/munged.log)"; }
    wait_for 10 munge_ok || die "munged started but 'munge -n | unmunge' fails (see /var/log/munge/munged.log)"
    cp /run/munge/munged.pid "$state/munged.pid"
    say "munged started (pid $(pid_of "$state/munged.pid"))"
}

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

write_conf() {
    local host=$1 cpus=${SLURM_ONEBOX_CPUS:-8}
    # Job ids that do not repeat across clusters started on this machine (a real cluster's never
    # do): MPICH under srun names its shared-memory segment after the job step, and a segment left
    # in /dev/shm by a killed rank of an earlier cluster's job 3.0 made the next cluster's job 3.0
    # hang in MPI_Init. Slurm's MaxJobId is 67043328.
    local first=$(( $(date +%s) % 60000000 + 1000 ))
    # KillWait: the seconds from a cancelled step's SIGTERM to its SIGKILL. srun --kill-on-bad-exit
    # cancels the step when a rank dies, and the survivors, blocked in a collective with the dead
    # rank, never act on the SIGTERM: every restart of `hpcasync launch --launcher srun` waited all
    # of it (10 s of the 16 s from the death to the resumed run in tests/mpi/test_slurm.py's
    # mpi-srun job). A real cluster's default is 30 s.
    local kill_wait=${SLURM_ONEBOX_KILL_WAIT:-2}
    mkdir -p "$state/ctld" "$state/spool" "$state/log"
    cat >"$conf" <<EOF
# One-machine Slurm written by scripts/slurm-cluster.sh; everything lives under $state.
ClusterName=onebox
SlurmctldHost=$host
SlurmctldPort=${SLURM_ONEBOX_CTLD_PORT:-6817}
SlurmdPort=${SLURM_ONEBOX_SLURMD_PORT:-6818}
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/spool
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
KillWait=$kill_wait
FirstJobId=$first
MinJobAge=600
NodeName=$host CPUs=$cpus RealMemory=20000 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}

node_idle() { sinfo -h -o '%t' 2>/dev/null | grep -qE '^(idle|mix|alloc)'; }

log_tail() {
    local f
    for f in "$state"/log/slurmctld.log "$state"/log/slurmd.log; do
        [ -f "$f" ] && { say "--- last lines of $f"; tail -n 8 "$f" >&2; }
    done
}

do_start() {
    need_root
    install_packages
    local ctld; ctld=$(pid_of "$state/slurmctld.pid")
    if alive "$ctld" && [ -f "$conf" ] && node_idle; then
        say "already running (slurmctld pid $ctld)"
        echo "export SLURM_CONF=$conf"
        return 0
    fi
    start_munge
    local host; host=$(hostname -s)
    getent hosts "$host" >/dev/null || die "hostname $host does not resolve (add it to /etc/hosts)"
    if ! alive "$ctld"; then
        local p
        for p in "${SLURM_ONEBOX_CTLD_PORT:-6817}" "${SLURM_ONEBOX_SLURMD_PORT:-6818}"; do
            port_busy "$p" && die "port $p is in use (another Slurm running?); set SLURM_ONEBOX_CTLD_PORT/SLURM_ONEBOX_SLURMD_PORT"
        done
        write_conf "$host"
        # -c: start clean, without recovering jobs of an earlier cluster in the same STATE_DIR.
        slurmctld -c -f "$conf" || { log_tail; die "slurmctld did not start"; }
    fi
    alive "$(pid_of "$state/slurmd.pid")" \
        || slurmd -f "$conf" || { log_tail; die "slurmd did not start"; }
    if ! wait_for "${SLURM_ONEBOX_WAIT:-60}" node_idle; then
        sinfo >&2 || true; log_tail
        die "node did not become idle within ${SLURM_ONEBOX_WAIT:-60}s"
    fi
    say "running: $(sinfo -h -o '%P %D %t %C (A/I/O/T cpus)' | head -1); state in $state"
    echo "export SLURM_CONF=$conf"
}

wait_gone() {  # wait up to $1 s for pid $2 to exit; then TERM, then KILL
    local limit=$1 pid=$2
    alive "$pid" || return 0
    wait_for "$limit" bash -c "! kill -0 $pid" && return 0
    say "pid $pid still alive after ${limit}s: sending TERM"
    kill -TERM "$pid" 2>/dev/null || true
    wait_for 5 bash -c "! kill -0 $pid" && return 0
    kill -KILL "$pid" 2>/dev/null || true
}

# Is a slurmctld/slurmd of another cluster running? (Looks only; ends nothing.)
other_slurm_running() {
    local c
    for c in /proc/[0-9]*/comm; do
        case $(cat "$c" 2>/dev/null) in slurmctld|slurmd) return 0;; esac
    done
    return 1
}

do_stop() {
    local ctld slurmd_pid munge_pid
    ctld=$(pid_of "$state/slurmctld.pid"); slurmd_pid=$(pid_of "$state/slurmd.pid")
    if alive "$ctld" || alive "$slurmd_pid"; then
        if alive "$ctld"; then
            timeout 10 scancel --quiet "--user=$(id -un)" 2>/dev/null || true
            timeout 15 scontrol shutdown >/dev/null 2>&1 || say "scontrol shutdown failed; ending daemons by pid"
        fi
        wait_gone 20 "$ctld"
        wait_gone 20 "$slurmd_pid"
        say "slurm daemons stopped"
    else
        say "no slurm daemons running for $state"
    fi
    munge_pid=$(pid_of "$state/munged.pid")
    if alive "$munge_pid" && [ "$(cat "/proc/$munge_pid/comm" 2>/dev/null)" = munged ]; then
        if other_slurm_running; then
            say "munged (pid $munge_pid) left running: another Slurm daemon on this machine uses it"
            rm -f "$state/munged.pid"
            return 0
        fi
        kill -TERM "$munge_pid"
        wait_gone 10 "$munge_pid"
        say "munged (pid $munge_pid) stopped"
    fi
    rm -f "$state/munged.pid"
}

do_status() {
    [ -f "$conf" ] || die "no cluster in $state"
    sinfo; squeue
}

case $action in
    start) do_start;;
    stop) do_stop;;
    status) do_status;;
    *) usage;;
esac
