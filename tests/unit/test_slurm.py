"""Slurm's environment reader (no cluster needed). The sbatch templates run end to end on a real
one-machine cluster in tests/mpi/test_slurm.py."""
from __future__ import annotations

import time

import pytest

from hpcasync.errors import TopologyError
from hpcasync.slurm import SlurmEnv, expand_nodelist


def test_from_environ_parses_a_job_step():
    env = SlurmEnv.from_environ({
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "hpcasync-mpi", "SLURM_JOB_NODELIST": "n[01-02]",
        "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_ID": "0",
        "SLURM_CPUS_PER_TASK": "2", "SLURM_GPUS_ON_NODE": "4", "SLURM_RESTART_COUNT": "1",
        "SLURM_SUBMIT_DIR": "/home/u/hpcasync", "SLURM_MPI_TYPE": "pmix", "HOME": "/home/u"})
    assert env == SlurmEnv(job_id="4242", job_name="hpcasync-mpi", nodelist="n[01-02]",
                           num_nodes=2, ntasks=8, procid=5, localid=1, nodeid=1, step_id="0",
                           cpus_per_task=2, gpus_on_node=4, submit_dir="/home/u/hpcasync",
                           restart_count=1, mpi_type="pmix")
    assert env.in_slurm and env.in_step and env.hosts() == ["n01", "n02"]
    assert env.run_name() == "slurm-4242"
    assert env.record()["ntasks"] == 8 and "array_job_id" not in env.record()
    env.check_world(8)                               # a real 8-rank world: fine
    with pytest.raises(TopologyError, match=r"srun started 8 tasks .* world of 1.*--mpi=pmix"):
        env.check_world(1)


def test_from_environ_outside_slurm_and_in_the_batch_shell():
    none = SlurmEnv.from_environ({"HOME": "/root", "OMPI_COMM_WORLD_RANK": "3"})
    assert none == SlurmEnv() and not none.in_slurm and not none.in_step
    assert all(v is None for v in vars(none).values())
    stamp = time.mktime((2026, 1, 2, 3, 4, 5, 0, 0, -1))
    assert none.run_name(now=stamp) == "local-20260102-030405"
    none.check_world(1)
    # mpirun ranks inside sbatch inherit the batch shell's SLURM_PROCID=0: not a step, no trap
    batch = SlurmEnv.from_environ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "0",
                                   "SLURM_ARRAY_JOB_ID": "6", "SLURM_ARRAY_TASK_ID": "1"})
    assert not batch.in_step and batch.ntasks == 4
    batch.check_world(1)
    assert batch.run_name() == "slurm-6_1"


def test_expand_nodelist():
    assert expand_nodelist("gpu[01-03,07],login1,x[9-10]-ib") == \
        ["gpu01", "gpu02", "gpu03", "gpu07", "login1", "x9-ib", "x10-ib"]
    assert expand_nodelist("vm") == ["vm"] and expand_nodelist(None) == []
