"""The CLI end to end, and failure behaviour: bad options, missing data, a crash on one rank.

Each test launches its own MPI job from rank 0 (the other ranks wait idle) and asserts a non-zero
exit within 30 s with the message shown."""
import json
import sys
import time

import pytest

from hpcasync.metrics import read_metrics
from tests.mpi_util import clean_env, error_lines, run_cli, run_mpi

SMALL = ["--dataset", "fashion-mnist-mini", "--train-limit", "2048", "--test-limit", "500",
         "--epochs", "1", "--progress", "off"]


# Every case stops in the option checks, before MPI starts, on every rank alike, and only the
# launcher's rank 0 (read from its environment: the MPI-dependent part) says it: the first two
# cases take that path under every MPI; the others are one_mpi (CI's MPICH pass leaves them out).
_TWIN = pytest.mark.one_mpi          # twins: the [epochs-0] and [algorithm] cases


@pytest.mark.rank0
@pytest.mark.parametrize("args, needle", [
    (["--epochs", "0"], "--epochs must be a positive integer"),
    (["--algorithm", "sgdx"], "--algorithm 'sgdx' is not one of"),
    pytest.param(["--lr", "nan"], "--lr must be a finite number", marks=_TWIN),
    pytest.param(["--batch-size", "x"], "invalid int value", marks=_TWIN),
    pytest.param(["--no-such-option"], "unrecognized arguments", marks=_TWIN),
    pytest.param(["--data-dir", "/nonexistent/dir"],
                 "--data-dir /nonexistent/dir: no such directory", marks=_TWIN),
    pytest.param(["--model", "vgg"], "--model 'vgg' is not one of", marks=_TWIN),
])
def test_bad_option_one_line_error_before_mpi(args, needle):
    t0 = time.time()
    r = run_mpi(4, ["train", *SMALL, *args], timeout=60)
    assert r.returncode != 0 and time.time() - t0 < 30
    lines = error_lines(r.stderr)
    assert len(lines) == 1, r.stderr            # said once (rank 0), not by every rank
    assert needle in lines[0]
    assert "Traceback" not in r.stderr


@pytest.mark.rank0
@pytest.mark.no_mpi            # two singletons that stop before MPI starts: any MPI gives the same runs
def test_config_file_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("epochs = 2\nnot_an_option = 1\n")
    r = run_cli(["train", "--config", str(bad)])
    assert r.returncode == 2 and "unknown option(s): not_an_option" in r.stderr
    broken = tmp_path / "broken.json"
    broken.write_text("{epochs: ")
    r = run_cli(["train", "--config", str(broken)])
    assert r.returncode == 2 and "not valid JSON" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.rank0
@pytest.mark.no_mpi            # singletons that stop before MPI starts: any MPI gives the same runs
def test_cli_rejects_bad_daso_knobs_in_one_line():
    """(Here, not in test_daso.py, whose tests need 4 ranks: CI runs the no_mpi tests in one
    process.)"""
    for args, what in ((["--daso-global-skip", "16"], "max_global_skips"),
                       (["--daso-batches-to-wait", "0"], "batches_to_wait"),
                       (["--daso-link-delay-us-per-mb", "-3"], "link delay")):
        bad = run_cli(["train", "--algorithm", "daso", "--dataset", "fashion-mnist-mini", *args])
        assert bad.returncode == 2, bad.stderr
        lines = [ln for ln in bad.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and what in lines[0], bad.stderr


@pytest.mark.rank0
@pytest.mark.one_mpi   # read before MPI starts on every rank: test_bad_input.py[idx-truncated]'s path
def test_missing_dataset_files(tmp_path):
    r = run_mpi(2, ["train", "--dataset", "fashion-mnist", "--data-dir", str(tmp_path), "--epochs", "1"],
                timeout=60)
    assert r.returncode != 0
    lines = error_lines(r.stderr)
    assert len(lines) == 1 and "fashion-mnist not found" in lines[0] and str(tmp_path) in lines[0], r.stderr


@pytest.mark.rank0
def test_crash_on_one_rank_aborts_job_fast():
    t0 = time.time()
    r = run_mpi(4, ["train", *SMALL, "--epochs", "5"], timeout=120,
                env=clean_env(HPCASYNC_INJECT_FAULT="2:5"))
    elapsed = time.time() - t0
    assert r.returncode != 0
    assert "rank 2 failed" in r.stderr and "injected fault" in r.stderr, r.stderr[-2000:]
    assert elapsed < 30, f"job took {elapsed:.1f}s to end after a crash"


@pytest.mark.rank0
def test_ssgd_run_writes_metrics_stream(tmp_path):
    out = tmp_path / "run.jsonl"
    r = run_mpi(4, ["train", *SMALL, "--train-limit", "6000", "--batch-size", "32",
                    "--metrics", str(out)], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    records = read_metrics(out)
    events = [rec["event"] for rec in records]
    assert events[0] == "config" and events[-1] == "summary" and events.count("epoch") == 1
    summary = records[-1]
    assert summary["algorithm"] == "ssgd" and summary["world_size"] == 4
    assert summary["test_accuracy"] > 0.6, summary       # 46 steps of 4 x 32 images
    assert records[1]["bytes_communicated"] > 0
    assert not (tmp_path / "run.jsonl.partial").exists()
    json.dumps(records)


@pytest.mark.rank0
@pytest.mark.one_mpi     # an import-time property; the run's MPI paths are the asgd tests'
@pytest.mark.parametrize("algorithm", ["asgd", "odsgd"])
def test_an_own_update_rule_run_never_imports_torch_dynamo(algorithm, tmp_path):
    """The algorithms with their own update rule build no torch optimizer, and their optimizer
    base skips torch's ``torch._disable_dynamo`` wrappers (hpcasync/optim.py): no rank imports
    ``torch._dynamo`` (2-3.5 CPU-s a rank), checkpoints included. tests/unit/test_optim_base.py
    checks the base alone."""
    r = run_mpi(4, ["--", sys.executable, "-X", "importtime", "-m", "hpcasync.cli", "train",
                    "--algorithm", algorithm, *SMALL, "--train-limit", "512",
                    "--checkpoint-dir", str(tmp_path)], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    imported = [line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines()
                if line.startswith("import time:")]
    assert imported.count("torch") == 4, r.stderr[-2000:]     # every rank's table is there
    assert "torch._dynamo" not in imported
    assert list(tmp_path.glob("ckpt-*")), "no checkpoint written"


@pytest.mark.rank0
def test_info_reports_virtual_nodes():
    r = run_mpi(4, ["info"], env=clean_env(HPCASYNC_RANKS_PER_NODE="2"), timeout=60)
    assert r.returncode == 0, r.stderr
    assert "4 ranks on 2 virtual node(s) of 2" in r.stdout


@pytest.mark.parametrize("argv, lr", [
    (["--algorithm", "ssgd"], 0.05), (["--algorithm", "nag"], 0.02),
    (["--algorithm", "nag", "--lr", "0.05"], 0.05), (["--algorithm", "smega2"], 0.05)])
def test_default_lr_is_per_algorithm_and_an_explicit_lr_wins(argv, lr):
    """NAG-ASGD's default lr is 0.02 (at 0.05 it collapsed in 5 of 16 runs: test_learning_bars)."""
    from hpcasync.cli import build_parser
    from hpcasync.config import TrainConfig, config_from_args, default_lr

    ns = build_parser().parse_args(["train", *argv])
    assert config_from_args(ns).lr == lr
    assert TrainConfig(algorithm="nag").lr == default_lr("nag") == 0.02


@pytest.mark.rank0
@pytest.mark.one_mpi     # the resume's MPI paths are test_resume_all's
def test_a_resume_with_another_lr_goes_on_with_it_and_says_so(tmp_path):
    """``--resume`` with a changed ``--lr``/``--weight-decay``: the run goes on with the command
    line's values, as the parameter server's and OD-SGD's resumes do, and says it once (a torch
    optimizer's ``load_state_dict`` brought the checkpoint's back: ``--lr 0.5`` trained at 0.05,
    silently). The same options resume bitwise (test_resume_all.py)."""
    from hpcasync.checkpoint import read_checkpoint

    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    base = ["train", "--algorithm", "localsgd", "--localsgd-warmup-steps", "2", *SMALL,
            "--train-limit", "512", "--checkpoint-dir", str(ck), "--metrics", str(m)]
    r = run_mpi(2, [*base, "--lr", "0.05"], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_mpi(2, [*base, "--epochs", "2", "--lr", "0.5", "--weight-decay", "0.001", "--resume",
                    "auto"], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    said = [ln for ln in r.stderr.splitlines() if "resumed with this run's" in ln]
    assert len(said) == 1 and "--lr 0.5, --weight-decay 0.001" in said[0], r.stderr[-2000:]
    assert "lr 0.05, weight_decay 0.0" in said[0]
    groups = [read_checkpoint(p)[1]["optimizer"]["param_groups"] for p in sorted(ck.glob("*.pt"))]
    assert [(g[0]["lr"], g[0]["weight_decay"]) for g in groups] == [(0.05, 0.0), (0.5, 0.001)]
    # the resumed run's metrics are kept, not replaced by the resume's (the same --metrics)
    assert [r["epoch"] for r in read_metrics(str(m) + ".1") if r["event"] == "epoch"] == [1]
    assert [r["epoch"] for r in read_metrics(m) if r["event"] == "epoch"] == [2]
    assert "--metrics %s held a run's records: kept as %s.1" % (m, m) in r.stderr
    # resumed where --epochs is already reached: exit 0 (a requeued job), said once
    r = run_mpi(2, [*base, "--epochs", "2", "--lr", "0.5", "--weight-decay", "0.001", "--resume",
                    "auto"], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("had trained --epochs 2 already: nothing was trained") == 1


def test_fault_tolerance_asked_for_without_ulfm_is_said_once():
    """``--grow-back``/``--min-ranks`` (the CLI) and ``@hpcasync.elastic.run(grow_back=True)``
    (your own loop) under a launch without ULFM: the run goes on as without them, and says so
    once (they did nothing, without a word). Under MPICH the same (no ULFM there)."""
    r = run_mpi(2, ["train", "--algorithm", "asgd", *SMALL, "--train-limit", "512", "--grow-back",
                    "--min-ranks", "2"], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    said = [ln for ln in r.stderr.splitlines() if "does not run under ULFM" in ln]
    assert len(said) == 1 and "--grow-back and --min-ranks asked for" in said[0], r.stderr[-2000:]
    script = ("import torch, hpcasync\n"
              "hpcasync.init('ssgd')\n"
              "model = torch.nn.Linear(2, 1)\n"
              "opt = hpcasync.optimizer('ssgd', model, torch.optim.SGD(model.parameters(), lr=0.1))\n"
              "state = hpcasync.elastic.State(model=model, optimizer=opt)\n"
              "@hpcasync.elastic.run(grow_back=True)\n"
              "def train(state):\n"
              "    state.commit()\n"
              "train(state)\n")
    r = run_mpi(2, ["--", sys.executable, "-c", script], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    said = [ln for ln in r.stderr.splitlines() if "does not run under ULFM" in ln]
    assert len(said) == 1 and "grow-back asked for" in said[0], r.stderr[-2000:]


def test_a_checkpoint_of_another_world_size_resumes_with_the_rest_of_its_epoch_resharded(
        tmp_path):
    """A job requeued on fewer (or more) ranks: a synchronous family's checkpoint written by 4
    ranks inside epoch 1 (batch 10 of 16) resumes on 2 — every rank from rank 0's state, the
    rest of the epoch (6 batches x 4 ranks) re-sharded over 2 ranks (12 batches), said once;
    it was one line, "world_size is 4, this run has 2" (your own loop's persist already went on
    from rank 0's). DASO resumes so from an epoch's end; from inside one (its schedule counts
    that epoch over the world that began it) it is one line. The parameter server, whose rule
    keeps per-worker state, still refuses another size."""
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    base = ["train", *SMALL, "--batch-size", "32", "--checkpoint-dir", str(ck)]
    r = run_mpi(4, [*base, "--algorithm", "ssgd", "--checkpoint-every", "5"], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    for p in ck.glob("*.pt"):
        if p.name != "ckpt-e0001-s00000010.pt":
            p.unlink()
    r = run_mpi(2, [*base, "--algorithm", "ssgd", "--epochs", "2", "--resume", "auto",
                    "--metrics", str(m)], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    said = [ln for ln in r.stderr.splitlines() if "from a checkpoint written by" in ln]
    assert len(said) == 1 and said[0].endswith(
        "resumed on 2 ranks from a checkpoint written by 4: the rest of epoch 1 (10 of its "
        "batches done) re-sharded over 2"), r.stderr[-2000:]
    summary = [x for x in read_metrics(m) if x["event"] == "summary"][-1]
    assert summary["steps"] == 10 + 12 + 32, summary["steps"]     # epoch 2: 2048 / 2 / 32
    assert sorted(p.name for p in ck.glob("*.pt"))[:2] == ["ckpt-e0001-s00000010.pt",
                                                            "ckpt-e0001-s00000022.pt"]
    # DASO: from an epoch's end (the next epoch planned over 2 ranks: 32 batches), not from
    # inside one (its schedule counts that epoch's batches over the writer's 4)
    d, md = tmp_path / "d", tmp_path / "d.jsonl"
    daso = [*base, "--algorithm", "daso", "--checkpoint-dir", str(d), "--daso-warmup-epochs", "1",
            "--daso-cooldown-epochs", "0"]
    r = run_mpi(4, [*daso, "--checkpoint-every", "5"], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_mpi(2, [*daso, "--epochs", "2", "--resume", str(d / "ckpt-e0001-s00000010.pt")],
                timeout=120)
    assert r.returncode != 0 and error_lines(r.stderr)[0].endswith(
        "DASO checkpoint written by 4 ranks inside epoch 1 (batch 10): its schedule counts that "
        "epoch's batches over 4 ranks; resume it on 4 ranks, or on 2 from a checkpoint at an "
        "epoch's end"), r.stderr[-2000:]
    r = run_mpi(2, [*daso, "--epochs", "2", "--resume", "auto", "--metrics", str(md)],
                timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    epochs = [x for x in read_metrics(md) if x["event"] == "epoch"]
    assert [(x["epoch"], x["daso_batches"]) for x in epochs] == [(2, 32)]
    assert [x for x in read_metrics(md) if x["event"] == "summary"][-1]["steps"] == 16 + 32
