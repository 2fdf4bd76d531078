"""What Slurm tells a job about itself, read from the environment.

Slurm describes a job to its processes through ``SLURM_*`` variables: the job id and name, the
nodes, and — for processes that ``srun`` started as tasks of a job step — the task's global rank
(``SLURM_PROCID``), its rank on the node (``SLURM_LOCALID``) and the step's task count. Ranks that
``mpirun`` starts inside an allocation inherit the *batch shell's* values instead (every one of them
sees ``SLURM_PROCID=0``), so the per-task fields are only trusted inside a step
(:attr:`SlurmEnv.in_step`); MPI's own rank is the truth either way.

One trap is checked here: Open MPI 5 started by a plain ``srun`` (no ``--mpi=pmix``) comes up as N
separate jobs of size 1, each training alone. :meth:`SlurmEnv.check_world` turns that into a
one-line :class:`~hpcasync.errors.TopologyError`.

Example::

    env = SlurmEnv.from_environ()
    env.check_world(comm.Get_size())        # after MPI_Init
    metrics_path = f"runs/{env.run_name()}.jsonl"   # slurm-1234.jsonl or local-<time>.jsonl
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import asdict, dataclass
from typing import Mapping

from .errors import TopologyError

__all__ = ["SlurmEnv", "expand_nodelist"]


def _int(value: str | None) -> int | None:
    if value is None:
        return None
    m = re.match(r"\s*(\d+)", value)      # "4(x2)" style counts: the leading number
    return int(m.group(1)) if m else None


def expand_nodelist(nodelist: str | None) -> list[str]:
    """Host names of a Slurm node list: ``"gpu[01-03,07],login1"`` → gpu01, gpu02, gpu03, gpu07,
    login1 (zero padding kept; one bracket group per name, as Slurm writes them)."""
    if not nodelist:
        return []
    hosts: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]*)\])?([^,\[]*)(?:,|$)", nodelist):
        prefix, ranges, suffix = m.group(1), m.group(2), m.group(3)
        if not prefix and ranges is None:
            continue
        if ranges is None:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not hi:
                hosts.append(f"{prefix}{lo}{suffix}")
                continue
            width = len(lo)
            for i in range(int(lo), int(hi) + 1):
                hosts.append(f"{prefix}{i:0{width}d}{suffix}")
    return hosts


@dataclass(frozen=True)
class SlurmEnv:
    """The Slurm job this process belongs to; every field is None outside Slurm.

    Fields: ``job_id``, ``job_name``, ``nodelist`` (compressed, as Slurm gives it), ``num_nodes``,
    ``ntasks`` (tasks of the job step when inside one, else of the job), ``procid``, ``localid``,
    ``nodeid`` (this task's global / node-local / node index), ``step_id``, ``cpus_per_task``,
    ``gpus_on_node``, ``submit_dir``, ``restart_count`` (times the job was requeued),
    ``array_job_id``, ``array_task_id``, ``mpi_type`` (``srun --mpi=…``).
    """

    job_id: str | None = None
    job_name: str | None = None
    nodelist: str | None = None
    num_nodes: int | None = None
    ntasks: int | None = None
    procid: int | None = None
    localid: int | None = None
    nodeid: int | None = None
    step_id: str | None = None
    cpus_per_task: int | None = None
    gpus_on_node: int | None = None
    submit_dir: str | None = None
    restart_count: int | None = None
    array_job_id: str | None = None
    array_task_id: str | None = None
    mpi_type: str | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "SlurmEnv":
        """Read ``environ`` (default ``os.environ``); all fields None when there is no Slurm job."""
        env = os.environ if environ is None else environ
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if not job_id:
            return cls()
        g = env.get
        return cls(
            job_id=job_id, job_name=g("SLURM_JOB_NAME"),
            nodelist=g("SLURM_JOB_NODELIST") or g("SLURM_NODELIST"),
            num_nodes=_int(g("SLURM_JOB_NUM_NODES") or g("SLURM_NNODES")),
            ntasks=_int(g("SLURM_STEP_NUM_TASKS") or g("SLURM_NTASKS") or g("SLURM_NPROCS")),
            procid=_int(g("SLURM_PROCID")), localid=_int(g("SLURM_LOCALID")),
            nodeid=_int(g("SLURM_NODEID")), step_id=g("SLURM_STEP_ID") or g("SLURM_STEPID"),
            cpus_per_task=_int(g("SLURM_CPUS_PER_TASK")),
            gpus_on_node=_int(g("SLURM_GPUS_ON_NODE")),
            submit_dir=g("SLURM_SUBMIT_DIR"), restart_count=_int(g("SLURM_RESTART_COUNT")),
            array_job_id=g("SLURM_ARRAY_JOB_ID"), array_task_id=g("SLURM_ARRAY_TASK_ID"),
            mpi_type=g("SLURM_MPI_TYPE"))

    @property
    def in_slurm(self) -> bool:
        return self.job_id is not None

    @property
    def in_step(self) -> bool:
        """True for a task that ``srun`` started (its procid/localid are its own); False in the
        batch shell and in the processes it starts directly (``mpirun`` ranks)."""
        return self.step_id is not None and self.step_id not in ("batch", "extern")

    def hosts(self) -> list[str]:
        """The job's host names, expanded from :attr:`nodelist`."""
        return expand_nodelist(self.nodelist)

    def run_name(self, now: float | None = None) -> str:
        """``slurm-<jobid>`` (``slurm-<arrayjob>_<task>`` for an array task) inside Slurm, else
        ``local-YYYYmmdd-HHMMSS`` from ``now`` (default: the current time)."""
        if self.array_job_id and self.array_task_id:
            return f"slurm-{self.array_job_id}_{self.array_task_id}"
        if self.job_id:
            return f"slurm-{self.job_id}"
        return "local-" + time.strftime("%Y%m%d-%H%M%S", time.localtime(now))

    def check_world(self, world_size: int) -> None:
        """Raise TopologyError when srun started several tasks but MPI sees a world of 1 (Open MPI
        launched by srun without PMIx: every task is its own singleton job)."""
        if self.in_step and (self.ntasks or 1) > 1 and world_size == 1:
            raise TopologyError(
                f"srun started {self.ntasks} tasks but MPI sees a world of 1 in each "
                f"(srun --mpi={self.mpi_type or 'none'}): launch with `srun --mpi=pmix` "
                "or with mpirun inside the allocation")

    def record(self) -> dict:
        """The non-None fields, for the metrics ``config`` record."""
        return {k: v for k, v in asdict(self).items() if v is not None}
