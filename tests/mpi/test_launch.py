"""hpcasync.launch: the launcher follows the MPI that mpi4py loads (Open MPI or MPICH), and fault
tolerance (ULFM) is Open-MPI-only. Real jobs: the command must start one world of N ranks of the
same library (a launcher of the other MPI would start N singletons, or refuse its options)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from mpi4py import MPI

from hpcasync import launch
from hpcasync.errors import ConfigError
from hpcasync.runtime import ft
from tests.mpi_util import VENDOR, clean_env, error_lines, run_mpi

PROBE = ("import json, sys; from mpi4py import MPI; c = MPI.COMM_WORLD; "
         "open(f'{sys.argv[1]}/{c.Get_rank()}-{c.Get_size()}.json', 'x').write("
         "json.dumps([c.Get_rank(), c.Get_size(), MPI.Get_library_version()]))")
OTHER = {launch.OPEN_MPI: launch.MPICH, launch.MPICH: launch.OPEN_MPI}


def test_vendor_is_the_library_mpi4py_loaded():
    assert VENDOR in (launch.OPEN_MPI, launch.MPICH)
    assert launch.vendor_of(MPI.Get_library_version()) == VENDOR
    assert launch.launcher_vendor(launch.mpiexec_path()) == VENDOR
    assert launch.vendor_of("MPICH Version:      5.0.2\nMPICH ABI: 18:2:6") == launch.MPICH
    assert launch.vendor_of("Intel(R) MPI Library 2021.13 for Linux* OS") == launch.MPICH
    assert launch.vendor_of("Open MPI v5.0.11, package: Open MPI") == launch.OPEN_MPI
    assert launch.vendor_of("mpiexec (Open MPI) 5.0.11") == launch.OPEN_MPI
    assert launch.vendor_of("HYDRA build details:\n    Version: 5.0.2") == launch.MPICH


@pytest.mark.rank0
@pytest.mark.parametrize("n", [1, 3])
def test_the_command_starts_one_world_of_n_ranks_of_this_mpi(n, tmp_path):
    r = run_mpi(n, ["--", sys.executable, "-c", PROBE, str(tmp_path)], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    seen = sorted(json.loads(p.read_text()) for p in tmp_path.glob("*.json"))
    assert [(rank, size) for rank, size, _ in seen] == [(k, n) for k in range(n)], r.stdout
    assert {launch.vendor_of(lib) for _, _, lib in seen} == {VENDOR}


def test_argv_for_this_mpi():
    path = launch.mpiexec_path()
    got = launch.mpiexec_command(4)
    if VENDOR == launch.OPEN_MPI:
        assert got == [path, "--oversubscribe", "-n", "4"]
        assert launch.mpiexec_command(2, ft=True, bind="none") == \
            [path, "--with-ft", "ulfm", "--oversubscribe", "--bind-to", "none", "-n", "2"]
        assert launch.mpiexec_command(2, oversubscribe=False) == [path, "-n", "2"]
    else:
        assert got == [path, "-n", "4"]                      # hydra oversubscribes by itself
        assert launch.mpiexec_command(2, bind="none") == [path, "--bind-to", "none", "-n", "2"]
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ConfigError, match="number of ranks must be a positive integer"):
            launch.mpiexec_command(bad)


def test_a_launcher_of_the_other_mpi_is_a_one_line_error():
    other = OTHER[VENDOR]
    with pytest.raises(ConfigError, match=rf"is {launch.NAMES[VENDOR]}'s launcher but mpi4py "
                                          rf"loads {launch.NAMES[other]}") as err:
        launch.mpiexec_command(4, vendor=other)
    assert "\n" not in str(err.value)


def test_fault_tolerance_is_open_mpi_only():
    on = {ft.FT_ENV: "1"}
    for vendor in (launch.MPICH, launch.UNKNOWN):
        with pytest.raises(ConfigError, match=r"OMPI_MCA_mpi_ft_enable=1 \(fault tolerance\) "
                                              r"needs Open MPI \(its ULFM") as err:
            ft.check_ft_request(on, vendor)
        assert "\n" not in str(err.value)
        with pytest.raises(ConfigError, match="needs Open MPI"):
            launch.mpiexec_command(4, ft=True, vendor=vendor, mpiexec=launch.mpiexec_path())
        ft.check_ft_request({ft.FT_ENV: "0"}, vendor)              # not asked for: fine
    ft.check_ft_request(on, launch.OPEN_MPI)


@pytest.mark.rank0
def test_fault_tolerance_asked_for_under_mpich_ends_the_job_with_one_line():
    """Under MPICH a user's OMPI_MCA_mpi_ft_enable=1 stops every rank before MPI starts; under
    Open MPI the same variable starts a ULFM run (tests/mpi/reliability/test_worker_failure.py)."""
    if VENDOR == launch.OPEN_MPI:
        pytest.skip("MPICH only: under Open MPI fault tolerance is available")
    r = run_mpi(2, ["train", "--algorithm", "asgd", "--dataset", "fashion-mnist-mini",
                    "--train-limit", "256", "--test-limit", "100", "--epochs", "1",
                    "--progress", "off"], env=clean_env(**{ft.FT_ENV: "1"}), timeout=120)
    errors = error_lines(r.stderr)
    assert r.returncode == 2 and len(errors) == 1, r.stderr[-2000:]
    assert "needs Open MPI" in errors[0] and "MPICH" in errors[0]
    assert "Traceback" not in r.stderr


def test_child_env_drops_the_launchers_job_variables():
    parent = {"OMPI_COMM_WORLD_RANK": "1", "PMIX_RANK": "1", "PMI_RANK": "1", "PMI_FD": "9",
              "HYDI_CONTROL_FD": "7", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4",
              "SLURM_PROCID": "1", "OMPI_MCA_osc": "^ucx", "MPIR_CVAR_X": "1", "HOME": "/root"}
    env = launch.child_env(parent, PYTHONPATH="/x")
    assert {k: env[k] for k in ("OMPI_MCA_osc", "MPIR_CVAR_X", "HOME", "PYTHONPATH")} == \
        {"OMPI_MCA_osc": "^ucx", "MPIR_CVAR_X": "1", "HOME": "/root", "PYTHONPATH": "/x"}
    assert not {k for k in env if k.startswith(("OMPI_COMM", "PMI", "HYDI", "MPI_LOCAL",
                                                 "SLURM"))}
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == "1"


def test_the_resume_command_uses_this_mpis_launcher():
    cmd = ft.resume_command(4, ["train", "--algorithm", "asgd", "--resume", "x"])
    if VENDOR == launch.OPEN_MPI:
        assert cmd.startswith("mpirun --with-ft ulfm -n 4 ")
    else:
        assert cmd.startswith("mpiexec -n 4 ") and "ulfm" not in cmd
    assert cmd.endswith("train --algorithm asgd --resume auto")


@pytest.mark.rank0
def test_a_symlinked_launcher_still_starts_the_job(tmp_path):
    """A launcher reached through a symlink (a wrapper folder, as tests/mpi/test_slurm.py's stub
    uses): MPICH's hydra would look for its proxy beside the link and wait forever."""
    link = tmp_path / "bin" / "mpiexec"
    link.parent.mkdir()
    link.symlink_to(launch.mpiexec_path())
    out = tmp_path / "out"
    out.mkdir()
    cmd = [*launch.mpiexec_command(2, mpiexec=str(link)), sys.executable, "-c", PROBE, str(out)]
    r = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(p.name for p in out.glob("*.json")) == ["0-2.json", "1-2.json"]


#: plants an Open MPI session directory under this process's PID (the stale one a SIGKILLed
#: prterun leaves), builds the launch command, then execs the launcher in this same process: the
#: launcher runs under the planted PID, as after a PID wrap-around
PLANT_THEN_EXEC = r"""
import os, sys
base = sys.argv[1]
stale = os.path.join(base, f"ompi.{os.getpid()}")
os.makedirs(os.path.join(stale, "1"))
for name in ("pmix.vm.tool", f"pmix.vm.tool.{os.getpid()}",
             f"pmix.vm.tool.prterun-vm-{os.getpid()}@0"):
    open(os.path.join(stale, name), "w").write("stale rendezvous of a killed launcher\n")
from hpcasync import launch
if sys.argv[2] == "clear":
    cmd = launch.mpiexec_command(2)
else:                                            # the unfixed launch: no clearing
    launch.clear_stale_sessions = lambda tmpdir=None: []
    cmd = launch.mpiexec_command(2)
os.execv(cmd[0], [*cmd, sys.executable, "-c", "print('rank ran')"])
"""


@pytest.mark.rank0
def test_a_killed_launchers_session_directory_does_not_stop_the_next_launcher(tmp_path):
    """Open MPI: a prterun that gets the PID of one that was SIGKILLed found its stale session
    directory and stopped ("The PMIx server's listener thread failed to start": a CI failure of
    test_bad_input after ~2000 launches). The launch command clears such directories first."""
    if VENDOR != launch.OPEN_MPI:
        pytest.skip("Open MPI's session directories")
    # the host's short name is in the rendezvous file names: plant the ones this host would use
    import socket
    host = socket.gethostname().split(".")[0]
    script = PLANT_THEN_EXEC.replace("vm", host)
    env = clean_env(TMPDIR=str(tmp_path))
    bad = subprocess.run([sys.executable, "-c", script, str(tmp_path), "keep"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "listener thread failed to start" in bad.stderr, \
        (bad.returncode, bad.stdout, bad.stderr)             # the failure is real without the fix
    good = subprocess.run([sys.executable, "-c", script, str(tmp_path), "clear"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert good.returncode == 0 and good.stdout.count("rank ran") == 2, (good.stdout, good.stderr)
    # a running launcher's directory is kept; a PID that is no launcher now is stale too
    job = subprocess.Popen([*launch.mpiexec_command(1), sys.executable, "-c",
                            "import time; time.sleep(60)"], env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        live = tmp_path / f"ompi.{job.pid}"
        t0 = time.time()
        while not live.is_dir() and time.time() - t0 < 30:
            time.sleep(0.05)
        other = tmp_path / f"ompi.{os.getpid()}"           # this Python: alive, no launcher
        other.mkdir()
        assert launch.clear_stale_sessions(str(tmp_path)) == [str(other)] and live.is_dir()
    finally:
        job.terminate()
        job.wait(timeout=30)
