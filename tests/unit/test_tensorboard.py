"""TensorBoard output without MPI: a missing ``tensorboard`` package is a one-line error before
anything runs, a writer taking the stream over counts on in the same directory, a run that failed
on its input leaves no event file."""
import sys

import pytest

from hpcasync.errors import ConfigError
from hpcasync.metrics import MetricsWriter, read_metrics
from tests.mpi_util import clean_env, error_lines, run_cli
from tests.tb_util import assert_same, tb_scalars

FIX = "pip install hpcasync[tensorboard]"


def test_missing_tensorboard_is_one_line_naming_the_fix(tmp_path, monkeypatch):
    from hpcasync.config import TrainConfig
    from hpcasync.runtime import algorithms

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)     # import fails
    for make, flag in ((lambda: TrainConfig(tensorboard=str(tmp_path)).validate(algorithms()),
                        "--tensorboard"),
                       (lambda: MetricsWriter(None, tensorboard=tmp_path, enabled=False),
                        "tensorboard=")):
        with pytest.raises(ConfigError) as exc:
            make()
        message = str(exc.value)
        assert message.startswith(flag) and FIX in message and "\n" not in message


def test_cli_without_tensorboard_stops_before_training(tmp_path):
    stub = tmp_path / "stub" / "tensorboard"           # a tensorboard that does not import
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('not installed')\n")
    env = clean_env()
    env["PYTHONPATH"] = f"{stub.parent}:{env['PYTHONPATH']}"
    r = run_cli(["train", "--dataset", "fashion-mnist-mini", "--epochs", "1", "--metrics",
                 str(tmp_path / "run.jsonl"), "--tensorboard", str(tmp_path / "tb")], env=env)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = error_lines(r.stderr)
    assert len(lines) == 1 and "--tensorboard" in lines[0] and FIX in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "tb").exists() and not (tmp_path / "run.jsonl.partial").exists()


def test_a_writer_taking_over_counts_on_in_the_same_directory(tmp_path):
    path, tb = tmp_path / "run.jsonl", tmp_path / "tb"
    first = MetricsWriter(path, tensorboard=tb)
    first.write("config", world_size=4)
    for loss in (2.0, 1.5):
        first.write("step", epoch=1, loss=loss)
    first.write("epoch", epoch=1, test_accuracy=0.5)
    first.close(complete=False)                        # its rank died
    second = MetricsWriter(path, tensorboard=tb, enabled=False)
    second.reopen_append()
    assert second.epochs == {1}
    second.write("step", epoch=2, loss=1.0)
    second.write("epoch", epoch=2, test_accuracy=0.6)
    second.close()
    assert len(list(tb.glob("events.out.tfevents.*"))) == 2
    got = assert_same(read_metrics(path), tb)
    assert got["step/loss"] == [(0, 2.0), (1, 1.5), (2, 1.0)]
    assert [s for s, _ in got["epoch/test_accuracy"]] == [1, 2]


def test_a_run_failing_on_its_input_leaves_no_event_file(tmp_path):
    from hpcasync.train import discard_startup_stream

    for path in (tmp_path / "run.jsonl", None):       # with a stream, and TensorBoard alone
        tb = tmp_path / f"tb-{path is None}"
        m = MetricsWriter(path, tensorboard=tb)
        m.write("config", world_size=4)
        discard_startup_stream(m)
        assert not list(tb.iterdir()) and not list(tmp_path.glob("*.partial"))
        assert tb_scalars(tb) == {}
