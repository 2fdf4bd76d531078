"""Horovod's own PyTorch examples (tag v0.28.1), unchanged but for their ``import horovod...``
lines, under real Horovod and under ``hpcasync.horovod`` (issue 16).

The scripts are Horovod's files: not committed, not in Horovod's sdist. ``bash
scripts/fetch-horovod-examples.sh`` puts them in ``.cache/horovod-examples/`` (or set
``HPCASYNC_HOROVOD_EXAMPLES`` to a directory holding them); without them these tests skip and say
so (this project's CI machine reaches PyPI but not github.com). torchvision is the test-only
stand-in of ``tests/stand_ins/`` (its docstring: ``datasets.MNIST`` serves Fashion-MNIST).

* ``pytorch_mnist.py --epochs 1`` on 12000 / 2000 images: real Horovod and the facade train the
  same model from the same seed on the same batches, so they must print the same test accuracy
  up to the summation order of the averages (2 points);
* ``pytorch_synthetic_benchmark.py --model resnet18`` (batch 4, 224x224): both print their img/sec
  (the speed comparison itself is a benchmark: ``experiments/results/horovod_facade.md``).
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests.mpi_util import REPO, HOROVOD_ERROR, clean_env, mpiexec, need_horovod

EXAMPLES = Path(os.environ.get("HPCASYNC_HOROVOD_EXAMPLES", REPO / ".cache" / "horovod-examples"))
STAND_INS = REPO / "tests" / "stand_ins"
# the only lines changed: Horovod's imports -> the facade
FACADE_IMPORTS = {"import horovod.torch as hvd": "import hpcasync.horovod as hvd",
                  "import horovod\n": "import hpcasync.horovod as horovod\n"}
# the algorithm variants add keywords to the DistributedOptimizer call (after named_parameters)
# and, for a parameter-server rule, to hvd.init() — the one line that sets the server aside
NAMED = "named_parameters=model.named_parameters(),"
# test accuracy (%) after 1 epoch. Measured (4 ranks on 2 cores): Horovod 55.6, facade 55.6,
# daso (2 virtual nodes of 2, cycling from the start) 55.35, smega2 (1 server + 3 workers,
# asynchronous: varies run to run) 58.47; bars 5 and 10 points below Horovod's facade run
BARS = {"daso": 50.0, "smega2": 45.0}
ALGORITHM_LINES = {
    "daso": {NAMED: NAMED + ' algorithm="daso", epochs=args.epochs, '
             'steps_per_epoch=len(train_loader), warmup_epochs=0, cooldown_epochs=0,'},
    "smega2": {NAMED: NAMED + ' algorithm="smega2", steps_per_epoch=len(train_loader),',
               "hvd.init()": 'hvd.init(algorithm="smega2")'},
}


def _script(name: str) -> Path:
    path = EXAMPLES / name
    if not path.is_file():
        pytest.skip(f"{path} missing: run `bash scripts/fetch-horovod-examples.sh` (Horovod's "
                    "examples are not in its sdist; they are fetched from github.com)")
    return path


def _variant(name: str, backend: str, tmp_path: Path) -> Path:
    """The script as run with ``backend`` ("horovod": unchanged; "facade": imports replaced;
    "facade-ALGORITHM": and the algorithm's keywords added)."""
    src = _script(name)
    if backend == "horovod":
        need_horovod()
        return src
    text = src.read_text()
    for old, new in FACADE_IMPORTS.items():
        text = text.replace(old, new)
    assert "import horovod" not in text.replace("hpcasync.horovod", ""), "an import left"
    for old, new in ALGORITHM_LINES.get(backend.partition("-")[2], {}).items():
        assert text.count(old) == 1, (old, name)
        text = text.replace(old, new)
    out = tmp_path / f"{backend}-{name}"
    out.write_text(text)
    return out


def _run(script: Path, args: list[str], tmp_path: Path, timeout: float = 300, **env_extra):
    import subprocess

    env = clean_env(PYTHONPATH=os.pathsep.join([str(STAND_INS), str(REPO)]),
                    HPCASYNC_STANDIN_LIMIT="12000,2000", **env_extra)
    r = subprocess.run([*mpiexec(4), sys.executable, str(script), *args], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout


def _each_backend(name: str, args: list[str], pattern: str, tmp_path: Path,
                  backends=("facade",)) -> dict:
    """Run example ``name`` with each of ``backends`` and (when it imports) real Horovod; the one
    number ``pattern`` finds in each output, by backend. DASO runs on 2 virtual nodes of 2."""
    found = {}
    for backend in [*backends] + (["horovod"] if HOROVOD_ERROR is None else []):
        extra = {"HPCASYNC_RANKS_PER_NODE": "2"} if backend.endswith("daso") else {}
        out = _run(_variant(name, backend, tmp_path), args, tmp_path, **extra)
        values = re.findall(pattern, out)
        assert len(values) == 1, out[-2000:]
        found[backend] = float(values[0])
    return found


@pytest.mark.rank0
@pytest.mark.timeout(700)
def test_pytorch_mnist_example_reaches_horovods_accuracy(tmp_path):
    accuracy = _each_backend("pytorch_mnist.py", ["--epochs", "1", "--log-interval", "1000"],
                             r"Accuracy: ([\d.]+)%", tmp_path,
                             backends=("facade", "facade-daso", "facade-smega2"))
    print(f"pytorch_mnist.py, 1 epoch, 4 ranks: {accuracy}")
    assert accuracy["facade"] >= 50.0, accuracy
    assert accuracy["facade-daso"] >= BARS["daso"] and accuracy["facade-smega2"] >= BARS["smega2"]
    if "horovod" in accuracy:
        assert abs(accuracy["facade"] - accuracy["horovod"]) <= 2.0, accuracy
    else:
        need_horovod()                   # fails when CI built Horovod and it does not import


@pytest.mark.rank0
@pytest.mark.timeout(700)
def test_pytorch_synthetic_benchmark_example_runs(tmp_path):
    rates = _each_backend("pytorch_synthetic_benchmark.py",
                          ["--model", "resnet18", "--batch-size", "4", "--num-warmup-batches", "1",
                           "--num-batches-per-iter", "2", "--num-iters", "2"],
                          r"Total img/sec on 4 CPU\(s\): ([\d.]+)", tmp_path)
    print(f"pytorch_synthetic_benchmark.py resnet18 batch 4, 4 ranks, img/sec: {rates}")
    assert all(v > 0 for v in rates.values()), rates
