"""Bad input, end to end through the real CLI: each case feeds one bad option, config file, data
file, checkpoint or world size to ``hpcasync train`` and asserts

* a non-zero exit within 30 s,
* exactly one ``hpcasync: error`` line on stderr, naming the problem, and no traceback (a 4-rank
  job says it once, not once per rank),
* nothing written or overwritten: every file of the case's workspace (a pre-existing ``--metrics``
  file, a ``--checkpoint-dir`` holding a good checkpoint, the data and config files) has the same
  bytes and modification time afterwards, and no file appeared.

World-size and data cases run under ``mpiexec -n 4`` (``-n 1`` / ``-n 2`` where the size is the
point); option and config cases run as a plain ``python -m hpcasync`` (they fail before MPI starts;
tests/mpi/test_cli.py checks the 4-rank form of option errors). "Open MPI started by plain srun" is
emulated truthfully: four separate ``python -m hpcasync train`` processes, each with the SLURM_*
variables srun gives task k of a 4-task step and no MPI launcher variables, so each one's MPI comes
up as a singleton world, as under ``srun --mpi=none``.

Set ``HPCASYNC_CASES_MD=PATH`` to have the run write the table of cases
(tests/mpi/reliability/CASES.md).
"""
from __future__ import annotations

import gzip
import hashlib
import os
import pickle
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from tests.mpi_util import RANK, REPO, clean_env, run_cli, run_mpi

BUILTIN = REPO / "hpcasync" / "data" / "builtin"
MINI = ["--dataset", "fashion-mnist-mini", "--train-limit", "512", "--test-limit", "100",
        "--epochs", "1", "--progress", "off"]
LIMIT_S = 30.0
# Plain srun's N tasks are N whole singleton jobs started at once: each imports torch (the option
# parser's family modules do) before its MPI start can show the world of 1, so on 2 cores the case
# costs 4 start-ups side by side (7-8 s here idle under Open MPI, 13-14 s without the early check;
# 23-31 s beside a CI run's other work, 47 s in CI with a compiler beside it). Its bound covers
# those start-ups; the check itself runs right after MPI_Init, before the data and the model
# (cli._srun_world_check).
SRUN_LIMIT_S = 60.0
_RESULTS: list[dict] = []


@dataclass
class Case:
    """``twin``: a case whose MPI path is the twin's (CI's MPICH pass runs the twin only)."""
    id: str
    group: str
    what: str                      # the input, in words (the table's "input" column)
    launch: str                    # "cli" (singleton), "mpi1", "mpi2", "mpi4" or "srun4"
    args: Callable[["Workspace"], list[str]]
    needle: str                    # must appear in the error line
    ckpt_dir: bool = True          # pass --checkpoint-dir (holding a good checkpoint)
    twin: str = ""                 # marked one_mpi, naming the case that takes its MPI path


class Workspace:
    """A case's files: run/metrics.jsonl (from an earlier run), run/ckpt/ (a good checkpoint),
    data/ (a copy of the IDX files), all of which must be left untouched."""

    def __init__(self, root: Path, good_ckpt: Path | None):
        self.root, self.run, self.data = root, root / "run", root / "data"
        self.run.mkdir(parents=True)
        self.metrics = self.run / "metrics.jsonl"
        self.metrics.write_text('{"event": "summary", "note": "an earlier run"}\n')
        self.ckpt = self.run / "ckpt"
        self.ckpt.mkdir()
        self.good = None
        if good_ckpt is not None:
            self.good = self.ckpt / good_ckpt.name
            shutil.copy2(good_ckpt, self.good)

    def idx_dir(self) -> Path:
        """data/ with Fashion-MNIST (the built-in 6000/1000 subset), raw IDX, no gzip."""
        self.data.mkdir(exist_ok=True)
        for gz in BUILTIN.glob("*.gz"):
            (self.data / gz.name[:-3]).write_bytes(gzip.decompress(gz.read_bytes()))
        return self.data

    def file(self, name: str, data: bytes | str) -> Path:
        path = self.run / name
        path.write_bytes(data.encode() if isinstance(data, str) else data)
        return path

    def snapshot(self) -> dict[str, tuple[str, int]]:
        return {str(p.relative_to(self.root)): (hashlib.sha256(p.read_bytes()).hexdigest(),
                                                p.stat().st_mtime_ns)
                for p in sorted(self.root.rglob("*")) if p.is_file()}


# -- case inputs -----------------------------------------------------------------------------------

def _truncated_idx(ws):
    d = ws.idx_dir()
    f = d / "train-images-idx3-ubyte"
    f.write_bytes(f.read_bytes()[: 16 + 100 * 784 + 123])      # header + 100 images and a bit
    return ["--dataset", "fashion-mnist", "--data-dir", str(d)]


def _truncated_gz(ws):
    d = ws.idx_dir()
    raw = d / "t10k-labels-idx1-ubyte"
    gz = d / "t10k-labels-idx1-ubyte.gz"
    gz.write_bytes(gzip.compress(raw.read_bytes())[:300])       # a download cut short
    raw.unlink()
    return ["--dataset", "fashion-mnist", "--data-dir", str(d)]


def _wrong_magic(ws):
    d = ws.idx_dir()
    (d / "train-labels-idx1-ubyte").write_bytes(b"GIF89a" + bytes(64))   # another file's bytes
    return ["--dataset", "fashion-mnist", "--data-dir", str(d)]


def _count_mismatch(ws):
    d = ws.idx_dir()
    f = d / "t10k-labels-idx1-ubyte"
    data = f.read_bytes()
    f.write_bytes(data[:4] + (999).to_bytes(4, "big") + data[8:8 + 999])   # 999 labels, 1000 images
    return ["--dataset", "fashion-mnist", "--data-dir", str(d)]


class _Payload:
    def __init__(self, func, arg):
        self.func, self.arg = func, arg

    def __reduce__(self):
        return (self.func, (self.arg,))


def _evil_cifar(ws):
    d = ws.data / "cifar-10-batches-py"
    d.mkdir(parents=True)
    marker = ws.root / "PWNED"          # the payload would create it: the snapshot must not see it
    (d / "data_batch_1").write_bytes(pickle.dumps(
        {"data": _Payload(os.system, f"touch {marker}"), "labels": [0]}, protocol=2))
    return ["--dataset", "cifar10", "--data-dir", str(ws.data)]


def _missing_data(ws):
    ws.data.mkdir()
    return ["--dataset", "fashion-mnist", "--data-dir", str(ws.data)]


def _truncated_ckpt(ws):
    bad = ws.file("torn.pt", ws.good.read_bytes()[: ws.good.stat().st_size // 2])
    return ["--resume", str(bad)]


def _garbage_ckpt(ws):
    return ["--resume", str(ws.file("notes.pt", "these are my notes, not a checkpoint\n"))]


def _ps_checkpoint(ws) -> Path:
    """A parameter-server checkpoint's header (asgd, lenet, 4 ranks; its state is never read:
    the header is checked first)."""
    from hpcasync.checkpoint import save_checkpoint

    return save_checkpoint(ws.run / "asgd-4.pt", {"kind": "epoch"}, algorithm="asgd",
                           model="lenet", world_size=4, epoch=1, step=4)


def _config(name, text):
    return lambda ws: ["--config", str(ws.file(name, text))]


def _srun_env(k: int, n: int = 4) -> dict[str, str]:
    """What srun hands task k of an n-task step on one node (srun --mpi=none)."""
    return clean_env(SLURM_JOB_ID="4242", SLURM_JOBID="4242", SLURM_JOB_NAME="train",
                     SLURM_STEP_ID="0", SLURM_STEPID="0", SLURM_NTASKS=str(n),
                     SLURM_NPROCS=str(n), SLURM_STEP_NUM_TASKS=str(n), SLURM_PROCID=str(k),
                     SLURM_LOCALID=str(k), SLURM_NODEID="0", SLURM_NNODES="1",
                     SLURM_JOB_NUM_NODES="1", SLURM_NODELIST="node1", SLURM_JOB_NODELIST="node1",
                     SLURM_STEP_NODELIST="node1", SLURM_STEP_NUM_NODES="1",
                     SLURM_TASKS_PER_NODE=str(n), SLURM_MPI_TYPE="none")


CASES = [
    # command-line options
    Case("epochs-zero", "option", "--epochs 0", "cli", lambda ws: ["--epochs", "0"],
         "--epochs must be a positive integer, got 0"),
    Case("lr-nan", "option", "--lr nan", "cli", lambda ws: ["--lr", "nan"],
         "--lr must be a finite number > 0, got nan"),
    Case("unknown-algorithm", "option", "--algorithm sgdx (4 ranks)", "mpi4",
         lambda ws: ["--algorithm", "sgdx"], "--algorithm 'sgdx' is not one of"),
    Case("batch-not-int", "option", "--batch-size x", "cli", lambda ws: ["--batch-size", "x"],
         "argument --batch-size: invalid int value: 'x'"),
    Case("divergence-factor", "option", "--divergence-factor 0.5", "cli",
         lambda ws: ["--divergence-factor", "0.5"],
         "--divergence-factor must be 0 (off) or a finite number > 1, got 0.5"),
    Case("resume-auto-no-dir", "option", "--resume auto without --checkpoint-dir", "cli",
         lambda ws: ["--resume", "auto"], "--resume auto needs --checkpoint-dir", ckpt_dir=False),
    Case("metrics-dir-missing", "option", "--metrics into a directory that does not exist", "cli",
         lambda ws: ["--metrics", str(ws.root / "nowhere" / "m.jsonl")], "does not exist"),
    Case("checkpoint-dir-is-file", "option", "--checkpoint-dir names a file", "cli",
         lambda ws: ["--checkpoint-dir", str(ws.metrics)], "is not a directory", ckpt_dir=False),
    Case("checkpoint-dir-unwritable", "option", "--checkpoint-dir where nothing can be written",
         "cli", lambda ws: ["--checkpoint-dir", "/proc/hpcasync-ckpt"],
         "--checkpoint-dir /proc/hpcasync-ckpt: cannot write there", ckpt_dir=False),
    Case("diloco-sync-beyond-run", "option",
         "--algorithm diloco with its default H = 500 on a run of 4 inner steps (4 ranks)",
         "mpi4", lambda ws: ["--algorithm", "diloco"],
         "diloco: sync_every (--diloco-sync-every) 500 is more than the run's 4 inner steps",
         twin="ckpt-truncated"),
    Case("rennala-batch-beyond-run", "option",
         "--algorithm rennala --rennala-batch 1000 on a run of 15 pushes (4 ranks)", "mpi4",
         lambda ws: ["--algorithm", "rennala", "--rennala-batch", "1000"],
         "rennala: batch (--rennala-batch) 1000 is more than the run's 15 pushes in all",
         twin="ckpt-truncated"),
    Case("sync-no-batch", "option", "--train-limit 64 --batch-size 32 on 4 ranks (ssgd)", "mpi4",
         lambda ws: ["--train-limit", "64", "--batch-size", "32"],
         "each of the 4 ranks gets 16 training examples, fewer than one batch of 32",
         twin="ckpt-truncated"),
    # config files
    Case("config-unknown-key", "config", "TOML with an unknown key", "cli",
         _config("run.toml", "epochs = 2\nlearning_rate = 0.1\n"),
         "unknown option(s): learning_rate"),
    Case("config-bad-json", "config", "JSON that does not parse", "cli",
         _config("run.json", '{"epochs": 2,'), "not valid JSON"),
    Case("config-bad-toml", "config", "TOML that does not parse", "cli",
         _config("run.toml", "epochs = = 2\n"), "not valid TOML"),
    Case("config-wrong-type", "config", "TOML batch_size = 2.5", "cli",
         _config("run.toml", "batch_size = 2.5\n"),
         "--batch-size must be a positive integer, got 2.5"),
    # data files
    Case("idx-truncated", "data", "train images IDX cut after 100 images (4 ranks)", "mpi4",
         _truncated_idx, "train-images-idx3-ubyte: truncated"),
    Case("idx-gzip-truncated", "data", "test labels .gz cut to 300 bytes (4 ranks)", "mpi4",
         _truncated_gz, "t10k-labels-idx1-ubyte.gz: corrupt or truncated gzip stream",
         twin="idx-truncated"),
    Case("idx-wrong-magic", "data", "train labels file is a GIF (4 ranks)", "mpi4", _wrong_magic,
         "train-labels-idx1-ubyte: not an IDX file (magic 47494638",
         twin="idx-truncated"),
    Case("idx-count-mismatch", "data", "1000 test images, 999 test labels (4 ranks)", "mpi4",
         _count_mismatch, "has 1000 images but",
         twin="idx-truncated"),
    Case("cifar-executable-pickle", "data", "CIFAR batch whose pickle calls os.system (4 ranks)",
         "mpi4", _evil_cifar, "data_batch_1: executable pickle",
         twin="idx-truncated"),
    Case("data-missing", "data", "--data-dir without the data set", "cli", _missing_data,
         "fashion-mnist not found"),
    # checkpoints (the good one: ssgd, lenet, 4 ranks)
    Case("ckpt-truncated", "checkpoint", "--resume of a checkpoint cut in half (4 ranks)", "mpi4",
         _truncated_ckpt, "torn.pt: truncated"),
    Case("ckpt-garbage", "checkpoint", "--resume of a text file (4 ranks)", "mpi4", _garbage_ckpt,
         "notes.pt: not a checkpoint file",
         twin="ckpt-truncated"),
    Case("ckpt-other-model", "checkpoint", "lenet checkpoint, --model mlp (4 ranks)", "mpi4",
         lambda ws: ["--model", "mlp", "--resume", str(ws.good)],
         "model is 'lenet', this run has 'mlp'",
         twin="ckpt-truncated"),
    Case("ckpt-other-algorithm", "checkpoint", "ssgd checkpoint, --algorithm daso (4 ranks)",
         "mpi4", lambda ws: ["--algorithm", "daso", "--resume", "auto"],
         "algorithm is 'ssgd', this run has 'daso'"),
    # (a synchronous family's resumes on another world size: tests/mpi/test_cli.py; a parameter
    # server's keeps per-worker rule state)
    Case("ckpt-other-world-size", "checkpoint", "4-rank asgd checkpoint resumed on 2 ranks",
         "mpi2", lambda ws: ["--algorithm", "asgd", "--resume", str(_ps_checkpoint(ws))],
         "world_size is 4, this run has 2"),
    # world sizes
    Case("ps-one-rank", "world", "--algorithm asgd on 1 rank", "mpi1",
         lambda ws: ["--algorithm", "asgd"],
         "asgd needs a parameter server and at least one worker"),
    Case("ps-rank-missing", "world", "--algorithm asgd --ps-rank 4 on 4 ranks", "mpi4",
         lambda ws: ["--algorithm", "asgd", "--ps-rank", "4"],
         "ps rank 4 does not exist in a world of 4 ranks", twin="ckpt-other-world-size"),
    Case("daso-ranks-per-node", "world", "--algorithm daso --ranks-per-node 3 on 4 ranks", "mpi4",
         lambda ws: ["--algorithm", "daso", "--ranks-per-node", "3"],
         "cannot be grouped into virtual nodes of 3 ranks", twin="ckpt-other-world-size"),
    Case("srun-singletons", "world", "Open MPI under plain srun: 4 tasks, each a world of 1",
         "srun4", lambda ws: [], "srun started 4 tasks but MPI sees a world of 1"),
]


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    """A real checkpoint: ssgd, lenet, 4 ranks, one epoch of 4 steps (rank 0 only)."""
    if RANK != 0:
        return None
    ckdir = tmp_path_factory.mktemp("good") / "ckpt"
    r = run_mpi(4, ["train", *MINI, "--checkpoint-dir", str(ckdir)], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return sorted(ckdir.glob("ckpt-*.pt"))[-1]


def _launch(case: Case, args: list[str]) -> tuple[int, str, str]:
    full = ["train", *MINI, *args]
    if case.launch == "cli":
        r = run_cli(full, timeout=60)
    elif case.launch.startswith("mpi"):
        r = run_mpi(int(case.launch[3:]), full, timeout=60)
    else:
        return _launch_srun(full)
    return r.returncode, r.stdout, r.stderr


def _launch_srun(full: list[str], n: int = 4) -> tuple[int, str, str]:
    """Plain srun of n tasks: n independent processes. srun reports the first non-zero task exit;
    as with ``srun --kill-on-bad-exit`` the others are then killed, and must not have printed."""
    procs = [subprocess.Popen([sys.executable, "-m", "hpcasync", *full], env=_srun_env(k), cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k in range(n)]
    try:
        t0 = time.time()
        while all(p.poll() is None for p in procs) and time.time() - t0 < 60:
            time.sleep(0.05)
        first = next((k for k, p in enumerate(procs) if p.poll() is not None), None)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    outs = [p.communicate() for p in procs]
    assert first == 0, f"task {first} ended first: {outs}"      # task 0 speaks for the step
    return procs[0].returncode, "".join(o for o, _ in outs), "".join(e for _, e in outs)


def _marks(case: Case) -> list:
    """The "cli" cases are singletons that stop before MPI starts (checked with an atexit probe of
    mpi4py.MPI.Is_initialized() for each of them): no MPI job, so no_mpi; their 4-rank forms:
    tests/mpi/test_cli.py. The data cases' files, and a checkpoint named by --resume PATH, are all
    read before MPI starts (train.precheck), on every rank alike, and rank 0 (from the launcher's
    environment) says it: idx-truncated and ckpt-truncated take that path under every MPI, the
    others (``twin``) are one_mpi. ps-rank-missing and daso-ranks-per-node are raised once MPI
    runs, on every rank alike, as ckpt-other-world-size is (their twin). CI's MPICH pass leaves
    both kinds out."""
    if case.launch == "cli":
        return [pytest.mark.no_mpi]
    return [pytest.mark.one_mpi] if case.twin else []


@pytest.mark.rank0
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=_marks(c)) for c in CASES])
def test_bad_input(case, tmp_path, good_checkpoint):
    ws = Workspace(tmp_path / "ws", good_checkpoint)
    args = case.args(ws)
    base = ["--metrics", str(ws.metrics)] + (["--checkpoint-dir", str(ws.ckpt)] if case.ckpt_dir
                                             else [])
    before = ws.snapshot()
    t0 = time.time()
    code, out, err = _launch(case, base + args)
    elapsed = time.time() - t0
    # the launcher's own banners may run into our line: look for it anywhere in a line
    errors = [ln[ln.index("hpcasync: error"):] for ln in err.splitlines()
              if "hpcasync: error" in ln]
    shown = (errors[0] if errors else " / ".join(err.strip().splitlines()[-2:]))
    shown = shown.replace(str(ws.root), "WS")
    _RESULTS.append({"case": case, "line": shown, "code": code, "time": elapsed})
    assert code != 0, (out, err)
    limit = SRUN_LIMIT_S if case.launch == "srun4" else LIMIT_S
    assert elapsed < limit, f"{case.id} took {elapsed:.1f} s"
    assert len(errors) == 1 and err.count("hpcasync: error") == 1, err
    assert case.needle in errors[0], errors[0]
    assert "Traceback" not in err and "hpcasync: rank" not in err, err
    assert ws.snapshot() == before, "files were written or changed"


@pytest.fixture(scope="module", autouse=True)
def _cases_table():
    yield
    path = os.environ.get("HPCASYNC_CASES_MD")
    if RANK != 0 or not path or not _RESULTS:
        return
    rows = ["| case | input | what happened (error line) | exit code | time |",
            "|---|---|---|---|---|"]
    for r in _RESULTS:
        c = r["case"]
        line = r["line"].replace("|", "\\|")
        rows.append(f"| {c.group}: {c.id} | {c.what} | `` {line} `` | {r['code']} | "
                    f"{r['time']:.1f} s |")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    Path(path).write_text(
        "# Bad input: what was tried and what happened\n\n"
        "Generated by `HPCASYNC_CASES_MD=tests/mpi/reliability/CASES.md python -m pytest "
        "tests/mpi/reliability/test_bad_input.py` on a machine of "
        f"{os.cpu_count()} cores (load average at the end: "
        f"{load}). Time is wall time including the launcher and Python start-up. Every case "
        "also checks that no file was written or changed; WS is the case's temporary "
        "directory.\n\n" + "\n".join(rows) + "\n")
