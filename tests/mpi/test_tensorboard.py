"""TensorBoard output (``--tensorboard DIR``, ``open_metrics(..., tensorboard=DIR)``): the rank that
writes the JSONL stream writes the same numbers, at the same steps, to one event file."""
import pytest

import hpcasync
from hpcasync.metrics import read_metrics
from tests.mpi_util import COMM, RANK, idle_barrier, run_mpi
from tests.tb_util import assert_same


@pytest.mark.rank0
@pytest.mark.one_mpi     # the writer is the JSONL's: no MPI path of its own
def test_cli_run_writes_the_streams_numbers_from_the_server(tmp_path):
    """A PS run with the server on rank 1: its stream (epochs, pushes, summary) in TensorBoard."""
    out, tb = tmp_path / "run.jsonl", tmp_path / "tb"
    r = run_mpi(2, ["train", "--algorithm", "asgd", "--ps-rank", "1", "--dataset",
                    "fashion-mnist-mini", "--train-limit", "512", "--test-limit", "200",
                    "--epochs", "2", "--log-every", "8", "--progress", "off",
                    "--metrics", str(out), "--tensorboard", str(tb)], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(list(tb.glob("events.out.tfevents.*"))) == 1      # one writer
    records = read_metrics(out)
    got = assert_same(records, tb)
    assert [s for s, _ in got["epoch/test_accuracy"]] == [1, 2]
    assert [s for s, _ in got["push/loss"]] == [0, 1, 2, 3]          # no step field: counted
    assert got["epoch/pushes_per_worker/0"] == [(1, 16), (2, 16)]     # a list, flattened
    assert "epoch/staleness_histogram/0" in got                       # a dict, flattened


def test_own_loop_open_metrics_writes_tensorboard_on_the_root_alone(tmp_path_factory):
    d = COMM.bcast(tmp_path_factory.mktemp("tb") if RANK == 0 else None)
    path, tb = d / "run.jsonl", d / "tb"
    with hpcasync.open_metrics(path, tensorboard=tb) as m:
        for step in (10, 20):
            m.write("train", step=step, loss=1.0 / step, rank=RANK, ok=True)
        m.write("epoch", epoch=1, test_accuracy=0.75, per_worker=[3, 4.5, "x"],
                bytes={"sent": 1 << 20, "note": "n"}, rank=RANK)
        m.write("note", text="a string", big=123456789)
    idle_barrier()
    if RANK == 0:
        assert len(list(tb.glob("events.out.tfevents.*"))) == 1
        got = assert_same(read_metrics(path), tb)
        assert got["train/loss"] == [(10, pytest.approx(0.1)), (20, pytest.approx(0.05))]
        assert got["epoch/rank"] == [(1, 0)] and "train/ok" not in got        # rank 0's; no bools
        assert got["epoch/per_worker/0"] == [(1, 3)] and got["epoch/per_worker/1"] == [(1, 4.5)]
        assert got["epoch/bytes/sent"] == [(1, 1 << 20)]
        assert not any(t.endswith(("per_worker/2", "bytes/note")) for t in got)
        assert got["note/big"] == [(0, pytest.approx(123456789, rel=1e-7))]   # float32
