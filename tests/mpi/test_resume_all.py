"""Resume end to end for every one of the algorithms (``hpcasync.api.algorithms()``).

**One worker or replica pair, bitwise.** One MPI job of 2 ranks (``python -m
tests.mpi.test_resume_all``, launched by rank 0 through ``run_mpi``) runs the command line's own entry
point (``hpcasync.cli.main``: argument parsing, driver, runtimes, checkpoint files, ``--resume
auto``) 40 times in a row, which spares 40 job start-ups; for each algorithm

1. an uninterrupted run (the reference);
2. the same run stopped part-way: ``HPCASYNC_INJECT_SIGNAL`` makes one rank send itself SIGUSR1
   (the preemption path: exit status 75 and a ``stop`` checkpoint) for odsgd and the PS
   rules; ssgd and daso, which have no such hook, write checkpoints during the reference run and
   the newer ones are deleted, leaving one from the middle of the run (ssgd: mid-epoch, daso: the
   end of its first epoch, before the cycling one);
3. ``--resume auto`` from that checkpoint.

With 2 ranks every algorithm is deterministic (the PS rules have one worker, so the push order is
fixed), so the property is exact: the resumed run's final parameters (``params_sha256``) and every
resumed epoch's test loss equal the uninterrupted run's, bitwise; the resumed run starts at the
saved point (its ``resume`` record names the stop checkpoint, its epochs start at the saved one,
the PS's accepted count and the worker's position continue from the checkpoint) and does exactly
the remaining work. With one worker the staleness is 0, so DC-ASGD's backups and mean square,
LC-ASGD's loss history and SHAT's counts do not change a step: their resume is the rules'
round trip in tests/unit/test_rules.py (several workers, bitwise) and the tests below.

**Several workers** (in-process, the 4-rank pytest world: PS + 3 workers; not deterministic): the
rules not covered by tests/mpi/test_preemption_async.py (asgd, dana, dcasgd-a and shat there) are
stopped and resumed; every worker trains on from the checkpoint's state (bitwise: the loaded
rule's reply, or SHAT/SHAT-root/ENSEMBLE's own worker-local model as it was at the stop), the PS
continues its counts and epochs, and the accuracy ends near an uninterrupted run's. ENSEMBLE
(α = 0) is deterministic per worker, so its resumed workers end bitwise where uninterrupted ones
do. Last, the same for a user's loop (``hpcasync.save_checkpoint``/``load_checkpoint``).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

MINI = ["--dataset", "fashion-mnist-mini", "--train-limit", "512", "--test-limit", "200",
        "--model", "mlp", "--batch-size", "32", "--progress", "off", "--seed", "11"]
PER_EPOCH = {"sync": 512 // 2 // 32, "ps": 512 // 32}     # batches per rank / per worker: 8, 16
SSGD_EVERY, SSGD_KEEP = 6, 12            # ssgd: checkpoints at 6, 8 (epoch end), 12, 16: keep <= 12
PS_SIGNAL = 20                           # the worker signals itself at its 20th step (epoch 2)

# algorithm -> (extra options, how it is stopped)
PLAN: dict[str, tuple[list[str], str]] = {
    "ssgd": (["--momentum", "0.9", "--checkpoint-every", str(SSGD_EVERY)], "delete"),
    # epoch 2 cycling (two nodes of one rank): every 3 -> 3, 6, 8 (epoch end), 9, 12, ...; keep
    # <= 12: 12 (epoch 2, batch 4), inside the cycling epoch: every rank's replica and DASO
    # state (its sends in flight completed and kept) in the checkpoint per rank
    "daso": (["--momentum", "0.9", "--epochs", "3", "--ranks-per-node", "1",
              "--daso-warmup-epochs", "1", "--daso-cooldown-epochs", "1",
              "--daso-global-skip", "2", "--checkpoint-every", "3", "--checkpoint-keep", "20"],
             "delete"),
    # SSGD for 4 steps, then averages after steps 5, 7, 9, 11, ...: every 3 -> 3, 6, 8 (epoch
    # end), 9, 12, 15, 16; keep <= 12: 12 (epoch 2, batch 4), a local step: the replicas differ
    # there, each rank's own (replica, momentum) is in the checkpoint per rank
    "localsgd": (["--momentum", "0.9", "--localsgd-warmup-steps", "4", "--localsgd-period", "2",
                  "--checkpoint-every", "3"], "delete"),
    # an outer step every 3 (F = 1, α = 0: the replicas are equal right after it, where the CLI
    # checkpoints): every 3 -> 3, 6, 8 (epoch end), 9, 12, 15, 16; keep <= 12: 12 (epoch 2,
    # batch 4). The inner optimizer's momentum is each rank's own: in the checkpoint per rank
    "diloco": (["--momentum", "0.9", "--diloco-sync-every", "3", "--checkpoint-every", "3"],
               "delete"),
    "slowmo": (["--momentum", "0.9", "--slowmo-period", "3", "--checkpoint-every", "3"], "delete"),
    # ssgd with PowerSGD (compressed from step 2, error feedback): each rank's error memory is in
    # the checkpoint (per_rank); not an algorithm of its own (EXTRA)
    "ssgd+powersgd": (["--momentum", "0.9", "--checkpoint-every", str(SSGD_EVERY), "--compress",
                       "powersgd", "--powersgd-start-iter", "2", "--powersgd-rank", "2"],
                      "delete"),
    # signalled after step 5: the ranks agree at step 10 (every 10), after warm-up (4 steps)
    "odsgd": (["--odsgd-warmup-iters", "4"], "1:5"),
}
_PS_EXTRA = {"asgd": ["--ps-momentum", "0.5"], "dcasgd": [], "dcasgd-a": [],
             "lcasgd": [], "shat": ["--ps-momentum", "0.5"], "shat-root": [], "ensemble": [],
             "asp": [], "smega2": ["--momentum", "0.9"], "dana": ["--momentum", "0.9"],
             "nag": ["--momentum", "0.9"],
             # stopped after push 21 with B = 4: one gradient of a step in the server's sum
             "rennala": ["--rennala-batch", "4", "--ps-momentum", "0.5"], "ringmaster": [],
             "asgd-da": ["--ps-momentum", "0.5"]}
for _name, _extra in _PS_EXTRA.items():
    PLAN[_name] = (_extra, f"1:{PS_SIGNAL}")


#: plans that are an algorithm with options (its name before the "+")
EXTRA = ("ssgd+powersgd",)
SYNC = ("ssgd", "ssgd+powersgd", "localsgd", "slowmo", "diloco")     # checkpoints every few steps
EVERY = (*SYNC, "daso")


def _args(algorithm: str) -> list[str]:
    extra = PLAN[algorithm][0]
    epochs = [] if "--epochs" in extra else ["--epochs", "2"]
    return ["train", "--algorithm", algorithm.split("+")[0], *MINI, *epochs, *extra]


# -- the job (every rank runs this) -------------------------------------------------------------

def _main(out: Path, algorithms: list[str]) -> None:
    from mpi4py import MPI

    from hpcasync import cli

    codes: dict[str, list[int]] = {}
    for name in algorithms:
        (out / name).mkdir(parents=True, exist_ok=True)
        base, how, ck = _args(name), PLAN[name][1], str(out / name / "ck")
        runs = [("ref", ["--checkpoint-dir", ck] if how == "delete" else [], None)]
        if how != "delete":
            runs.append(("a", ["--checkpoint-dir", ck], how))
        runs.append(("b", ["--checkpoint-dir", ck, "--resume", "auto"], None))
        codes[name] = []
        for label, extra, signal in runs:
            if label == "b" and how == "delete":
                MPI.COMM_WORLD.Barrier()
                if MPI.COMM_WORLD.Get_rank() == 0:
                    _delete_late(name, Path(ck))
                MPI.COMM_WORLD.Barrier()
            os.environ["HPCASYNC_INJECT_SIGNAL"] = signal or ""
            try:
                code = cli.main([*base, "--metrics", str(out / name / f"{label}.jsonl"), *extra])
            except SystemExit as exc:
                code = exc.code
            codes[name].append(code)
    if MPI.COMM_WORLD.Get_rank() == 0:
        (out / "codes.json").write_text(json.dumps(codes))


def _delete_late(name: str, ck: Path) -> None:
    """Leave the checkpoint to resume from: the one at step SSGD_KEEP at most."""
    from hpcasync.checkpoint import read_checkpoint

    for p in sorted(ck.glob("ckpt-*.pt")):
        header, _ = read_checkpoint(p)
        if header["step"] > SSGD_KEEP:
            p.unlink()


if __name__ == "__main__":
    _main(Path(sys.argv[1]), sys.argv[2:])
    sys.exit(0)


# -- the tests (rank 0 launches the job once, each algorithm's test reads its files) -------------

from hpcasync.api import algorithms  # noqa: E402
from hpcasync.checkpoint import read_checkpoint  # noqa: E402
from hpcasync.metrics import read_metrics  # noqa: E402
from tests.mpi_util import run_mpi  # noqa: E402

_job: dict = {}


def _run_job(tmp_path_factory) -> Path:
    if "out" not in _job:
        out = tmp_path_factory.mktemp("resume_all")
        r = run_mpi(2, ["--", sys.executable, "-m", "tests.mpi.test_resume_all", str(out),
                        *algorithms(), *EXTRA], timeout=540)
        _job["out"], _job["result"] = out, r
    r = _job["result"]
    assert r.returncode == 0, r.stderr[-4000:]
    return _job["out"]


@pytest.mark.rank0
@pytest.mark.timeout(600)
@pytest.mark.parametrize("algorithm", [*algorithms(), *EXTRA])
@pytest.mark.one_mpi       # MPICH: test_worker_failure's resume
def test_resumed_run_equals_uninterrupted(algorithm, tmp_path_factory):
    assert sorted(PLAN) == sorted([*algorithms(), *EXTRA]) and len(PLAN) == 21
    out = _run_job(tmp_path_factory)
    d = out / algorithm
    codes = json.loads((out / "codes.json").read_text())[algorithm]
    how = PLAN[algorithm][1]
    assert codes == ([0, 0] if how == "delete" else [0, 75, 0]), codes
    ref, got = read_metrics(d / "ref.jsonl"), read_metrics(d / "b.jsonl")
    ref_sum, got_sum = ref[-1], got[-1]
    assert ref_sum["event"] == got_sum["event"] == "summary"
    resume = [r for r in got if r["event"] == "resume"]
    assert len(resume) == 1
    header, state = read_checkpoint(resume[0]["path"])
    epochs = [r["epoch"] for r in got if r["event"] == "epoch"]
    total = ref_sum["epochs"]
    if how != "delete":
        stopped = read_metrics(d / "a.jsonl.partial")
        assert stopped[-1]["event"] == "preempted"
        saved = [r for r in stopped if r["event"] == "checkpoint"][-1]
        assert saved["path"] == resume[0]["path"]           # resumed from the stop checkpoint
    if algorithm in SYNC:           # each rank's own state kept where the ranks' differ
        if algorithm == "ssgd":
            assert "per_rank" not in state
        else:
            own = state["per_rank"]
            key = "powersgd_error" if algorithm == "ssgd+powersgd" else "optimizer_state"
            a, b = own[0][key], own[1][key]
            if key == "optimizer_state":
                a, b = a[0]["momentum_buffer"], b[0]["momentum_buffer"]
            assert len(own) == 2 and not torch.equal(a, b)
    if algorithm in (*SYNC, "daso", "odsgd"):
        per = PER_EPOCH["sync"]
        if algorithm in SYNC:
            assert header["step"] == SSGD_KEEP and (state["epoch"], state["batch"]) == (2, 4)
            assert epochs == [2]
            if algorithm == "localsgd":     # a local step: each rank's own replica is kept
                own = state["per_rank"]
                assert not torch.equal(own[0]["params"], own[1]["params"])
        elif algorithm == "daso":       # inside the cycling epoch: the replicas differ
            assert header["step"] == SSGD_KEEP and (state["epoch"], state["batch"]) == (2, 4)
            own = state["per_rank"]
            assert len(own) == 2 and not torch.equal(own[0]["model"][next(iter(own[0]["model"]))],
                                                     own[1]["model"][next(iter(own[1]["model"]))])
            assert epochs == [2, 3]
            assert got_sum["replicas_identical"] and ref_sum["replicas_identical"]
            assert got_sum["replica_checksum"] == ref_sum["replica_checksum"]
            assert got_sum["daso_schedule"] == ref_sum["daso_schedule"][1:]
        else:                   # stopped at the agreed step 10: epoch 2, batch 2
            assert header["step"] == 10 and (state["epoch"], state["batch"]) == (2, 10 - per)
            assert epochs == [2]
        assert got_sum["steps"] == ref_sum["steps"] == total * per     # counted on from the save
    else:
        per = PER_EPOCH["ps"]
        ps = state["ps"]
        # the worker's push PS_SIGNAL + 1 carried the stop: it was applied and was its last
        assert state["kind"] == "stop" and ps["positions"] == [PS_SIGNAL + 1]
        assert header["step"] == ps["stats"]["accepted"] == PS_SIGNAL + 1
        if algorithm == "rennala":          # 5 steps of 4 gradients and 1 in the sum
            assert (ps["rule"]["version"], ps["rule"]["collected"]) == (5, 1)
        else:
            assert ps["rule"]["version"] == PS_SIGNAL + 1
        assert got_sum["resumed_at_push"] == PS_SIGNAL + 1
        assert got_sum["pushes"] == ref_sum["pushes"] == total * per    # the same total work
        assert [w["worker_start_step"] for w in got_sum["workers"]] == [PS_SIGNAL + 1]
        assert [w["worker_steps"] for w in got_sum["workers"]] == [total * per]
        assert epochs == [2]                                # epoch 1 was crossed before the stop
    ref_epochs = [r for r in ref if r["event"] == "epoch"]
    got_epochs = [r for r in got if r["event"] == "epoch"]
    for a, b in zip(ref_epochs[-len(got_epochs):], got_epochs):
        assert a["epoch"] == b["epoch"] and a["test_loss"] == b["test_loss"], (a, b)
    assert got_sum["params_sha256"] == ref_sum["params_sha256"]      # bitwise the same model


# -- several workers, in-process (the 4-rank pytest world: PS + 3 workers) ----------------------
#
# Not deterministic (the push order is the arrival order), so the property is the continuation:
# the stop checkpoint is consistent, the resumed PS continues its count and epochs from it, every
# worker continues at its position from the checkpoint's state -- the reply of the loaded rule, or,
# for the rules whose workers keep their own model (SHAT, SHAT-root, ENSEMBLE), bitwise the model
# it had when it stopped -- and does exactly the remaining work, and the accuracy ends close to an
# uninterrupted run's. (asgd, dana, dcasgd-a: tests/mpi/test_preemption_async.py.)

import torch  # noqa: E402

from hpcasync.launch import OPEN_MPI  # noqa: E402
from tests.mpi_util import COMM, RANK, SIZE, VENDOR  # noqa: E402

needs4 = pytest.mark.skipif(SIZE != 4, reason="needs the 4-rank MPI world (PS + 3 workers)")
W = 3
MULTI_BUDGET = 2 * ((1536 // W) // 32)          # pushes per worker: 2 epochs x 16 batches
# resumed - uninterrupted test accuracy (500 images): asynchronous runs differ by their push
# orders, most with momentum (nag: 0.61-0.68 over uninterrupted runs, one resumed run 0.47 on a
# box at load 15). Without momentum, 16 pairs on an idle box (dcasgd, lcasgd, asp, 2026-11-23):
# -0.086 ... +0.064, mean +0.006 (no bias); CI at load saw asp -0.106. So the check is one-sided
# (a resume that hurts, not one that helps) with 0.15 without momentum, 0.25 with. The exact
# checks above are the property; this one only catches a resume that trains badly. Under MPICH
# the push order follows busy-polling ranks on 2 cores and varies more: shat -0.170 (0.556 vs
# 0.726) in one MPICH pass here, 2026-11-26; there every rule gets the margin with momentum.
# SHAT under Open MPI too: -0.196 (0.53 vs 0.726) in a clean-clone CI run, 2026-12-01 (passed 3
# of 3 alone right after): its workers keep their own models, so the resumed mix varies most; it
# and SHAT-root get the wider margin everywhere.
ACCURACY_MARGIN = {False: 0.15, True: 0.25}
if VENDOR != OPEN_MPI:
    ACCURACY_MARGIN = {False: 0.25, True: 0.25}
WIDE_MARGIN = ("smega2", "nag", "shat", "shat-root")
MULTI = ["dcasgd", "lcasgd", "shat", "shat-root", "ensemble", "asp", "smega2", "nag"]


def _multi_ctx(tmp_path, algorithm, *, resume=False, ckpt=True, models=None):
    """A RunContext as the driver builds it, checkpointing into rank 0's tmp_path; ``models``
    collects the model this rank builds."""
    from hpcasync.checkpoint import CheckpointManager, PreemptionFlag
    from hpcasync.config import TrainConfig
    from hpcasync.data import load_dataset
    from hpcasync.metrics import MetricsWriter
    from hpcasync.models import build_model
    from hpcasync.runtime.context import Progress, RunContext
    from hpcasync.topology import Topology

    ckdir = COMM.bcast(str(tmp_path / "ckpt") if RANK == 0 and ckpt else None, root=0)
    cfg = TrainConfig(algorithm=algorithm, dataset="fashion-mnist-mini", train_limit=1536,
                      test_limit=500, model="mlp", epochs=2, batch_size=32, progress="off",
                      seed=5, checkpoint_dir=ckdir, resume="auto" if resume else None)
    cfg.options = {"hetero": "HO", "straggler": None, "compute_time": "fixed", "push_delay": 0.0,
                   "ps_transport": "rma", "ps_momentum": 0.0}
    train, test = load_dataset(cfg.dataset, train_limit=cfg.train_limit, test_limit=cfg.test_limit)

    def make_model():
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.model, train.input_shape, train.num_classes)
        if models is not None:
            models.append(model)
        return model
    return RunContext(cfg=cfg, topo=Topology.build(COMM), train=train, test=test,
                      make_model=make_model, metrics=MetricsWriter(None, enabled=False),
                      progress=Progress(False), preempt=PreemptionFlag(),
                      checkpoints=CheckpointManager(ckdir, keep=50) if ckpt else None)


def _multi_run(ctx, inject=None):
    """``ps.runtime.run(ctx)``; with ``inject`` ("RANK:N") that rank signals itself at its N-th
    step and the run must stop (Preempted on every rank): returns None then."""
    from hpcasync.ps import runtime as ps
    from hpcasync.runtime.context import Preempted

    if inject:
        os.environ["HPCASYNC_INJECT_SIGNAL"] = inject
    try:
        if inject:
            with pytest.raises(Preempted):
                ps.run(ctx)
            return None
        return ps.run(ctx)
    finally:
        os.environ.pop("HPCASYNC_INJECT_SIGNAL", None)
        ctx.preempt.restore()


def _flat(model) -> torch.Tensor:
    from hpcasync.optim import as_flat

    return as_flat(model).params.detach().clone()


@needs4
@pytest.mark.parametrize("algorithm", MULTI)
def test_several_workers_continue_from_the_saved_state(algorithm, tmp_path):
    from hpcasync.ps.runtime import build_rule

    ref_models: list = []
    ref = _watch_last(_multi_ctx(tmp_path, algorithm, ckpt=False, models=ref_models), ref_models)
    _multi_run(ref)                            # uninterrupted: accuracy, ENSEMBLE's locals
    models: list = []
    _multi_run(_multi_ctx(tmp_path, algorithm, models=models), inject="2:20")
    stopped = _flat(models[0])                 # on a worker: its model after the stop reply
    models = []
    ctx = _watch_last(_multi_ctx(tmp_path, algorithm, resume=True, models=models), models)
    header, state = read_checkpoint(ctx.checkpoints.checkpoints()[0])
    first: dict = {}

    def record_first(module, args):            # the model the resumed worker trains from
        first.setdefault("params", _flat(module))
    ctx.make_model = _hooked(ctx.make_model, record_first)
    s = _multi_run(ctx).summary
    ps = state["ps"]
    theta = ps["rule"]["theta"]
    # every collective before any assert (a rank failing alone would leave the others waiting)
    trained = "params" in first       # no step after the resume: its budget was done at the stop
    own = COMM.allgather(RANK > 0 and trained and not torch.equal(first["params"], theta))[1:]
    positions = ps["positions"]
    # under load a worker can finish its whole budget before the stop (a clean-clone CI run:
    # KeyError 'params' on rank 1): it then trains nothing after the resume, and what it
    # resumes from is checked on the workers that have work left
    left = [p < MULTI_BUDGET for p in positions]
    assert state["kind"] == "stop" and header["step"] == sum(positions) == ps["rule"]["version"]
    assert positions[1] == 21                  # worker 1 (rank 2) stopped with its 21st push
    assert s["resumed_at_push"] == header["step"]
    assert s["pushes"] == W * MULTI_BUDGET and s["pushes_per_worker"] == [MULTI_BUDGET] * W
    assert [w["worker_start_step"] for w in s["workers"]] == positions
    assert [w["worker_steps"] for w in s["workers"]] == [MULTI_BUDGET] * W
    if RANK == 0:
        assert [r["epoch"] for r in ctx.history] == list(range(header["epoch"], 3))
        got, want = ctx.history[-1]["test_accuracy"], ref.history[-1]["test_accuracy"]
        assert got >= want - ACCURACY_MARGIN[algorithm in WIDE_MARGIN], (got, want)
    elif not left[RANK - 1]:
        assert not trained
    else:
        w = RANK - 1
        rule = build_rule(ctx.cfg, torch.zeros_like(theta), W)
        rule.load_state_dict(ps["rule"])
        if getattr(rule, "keeps_local", False):        # SHAT, SHAT-root, ENSEMBLE
            assert torch.equal(state["worker_locals"][w], stopped)
            assert torch.equal(first["params"], stopped)      # its own model, bitwise
        else:                                  # the loaded rule's reply (θ, or SMEGA2's θ̂)
            assert "worker_locals" not in state
            assert torch.equal(first["params"], rule.initial_reply(w).params)
        if algorithm == "ensemble":            # α = 0: a worker's path is its data's alone, so
            assert torch.equal(ctx.last_local, ref.last_local)     # resumed = uninterrupted
    if algorithm == "ensemble":                # every worker with work left had its own model
        assert all(o for o, more in zip(own, left) if more) and any(left)
    elif algorithm in ("shat", "shat-root"):
        assert any(own)


def _watch_last(ctx, models):
    """``ctx.last_local``: this worker's model after its last push (the run ends with θ)."""
    def after_step():
        type(ctx).after_step(ctx)
        ctx.last_local = _flat(models[0])
    ctx.after_step = after_step
    ctx.last_local = None
    return ctx


def _hooked(make_model, hook):
    def make():
        model = make_model()
        model.register_forward_pre_hook(hook)
        return model
    return make


# -- the user-loop API: hpcasync.save_checkpoint / load_checkpoint with a ParameterServer --------

@needs4
@pytest.mark.parametrize("algorithm", ["ensemble", "shat"])
def test_user_loop_checkpoint_keeps_the_workers_own_models(algorithm, tmp_path):
    """The server saves at its epoch crossing, each worker its own model at the end of its epoch
    (same labels); a loop started again on them trains every worker from its own model, bitwise.
    ENSEMBLE (α = 0: a worker's path is its data's alone) then ends exactly where an
    uninterrupted loop ends."""
    import torch.nn.functional as F

    import hpcasync
    from hpcasync.data import batches, load_dataset, shard_indices
    from hpcasync.models import build_model

    directory = COMM.bcast(str(tmp_path / "ck") if RANK == 0 else None, root=0)
    train, _ = load_dataset("fashion-mnist-mini", train_limit=768, test_limit=10)
    per = 768 // W // 32

    def loop(epochs: int, *, save: bool, resume: bool = False):
        """Returns (the model it trained from first, its model after its last step) on a worker."""
        torch.manual_seed(0)
        model = build_model("mlp", train.input_shape, train.num_classes)
        opt = hpcasync.optimizer(algorithm, model, lr=0.05, steps_per_epoch=per, comm=COMM,
                                 ps_rank=0)
        start = hpcasync.load_checkpoint(directory, model, opt)["epoch"] if resume else 0
        if opt.is_server:
            opt.serve(on_epoch=lambda e, m: save and hpcasync.save_checkpoint(
                directory, m, opt, epoch=start + e))
            return None, None
        seen: dict = {}

        def record_first(module, args):       # after the first reply (the optimizer's hook)
            seen.setdefault("first", _flat(module))
        model.register_forward_pre_hook(record_first)
        for epoch in range(start + 1, epochs + 1):
            idx = shard_indices(len(train), shard_index=opt.worker, num_shards=W, seed=0,
                                epoch=epoch)
            for x, y in batches(train, idx, 32):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
            if save:
                hpcasync.save_checkpoint(directory, model, opt, epoch=epoch)
        last = _flat(model)
        opt.finish()                           # the model becomes the server's θ
        return seen["first"], last

    _, whole = loop(2, save=False)
    _, saved = loop(1, save=True)
    first, last = loop(2, save=False, resume=True)
    if RANK:
        assert torch.equal(first, saved)       # the worker trained on from its own model
        if algorithm == "ensemble":
            assert torch.equal(last, whole)


def test_a_resume_is_read_by_rank_0_alone_and_broadcast(tmp_path, monkeypatch):
    """``RunContext.resume_state`` (every CLI resume): rank 0 reads the checkpoint, once, and the
    others receive it (planted: every rank reads -> caught); ``--resume PATH`` the same; a
    checkpoint of another world size is the same CheckpointError on every rank; an empty
    directory is a fresh start everywhere."""
    import hpcasync.checkpoint as ckpt
    from hpcasync.errors import CheckpointError

    reads: list = []
    real_read = ckpt.read_checkpoint
    monkeypatch.setattr(ckpt, "read_checkpoint",
                        lambda path, **kw: reads.append(path) or real_read(path, **kw))
    ctx = _multi_ctx(tmp_path, "ssgd", resume=True)
    assert ctx.resume_state() is None and reads == []                  # nothing there yet
    state = {"model": {"w": torch.arange(5.0)}, "epoch": 1, "step": 3, "rank_failures": []}
    path = None
    if RANK == 0:
        ctx.checkpoints.save({**state, "step": 2}, 1, 2, **ctx.checkpoint_header())
        path = str(ctx.checkpoints.save(state, 1, 3, **ctx.checkpoint_header()))
    path = COMM.bcast(path, root=0)
    got = ctx.resume_state()
    assert COMM.allgather(len(reads)) == [1] + [0] * (SIZE - 1)        # the newest, on rank 0
    assert (got["step"], torch.equal(got["model"]["w"], torch.arange(5.0))) == (3, True)
    reads.clear()
    ctx.cfg.resume = path
    assert ctx.resume_state()["step"] == 3
    assert COMM.allgather(len(reads)) == [1] + [0] * (SIZE - 1)
    if RANK == 0:
        ctx.checkpoints.save(state, 1, 4, **{**ctx.checkpoint_header(), "world_size": SIZE + 1})
    COMM.Barrier()
    ctx.cfg.resume = "auto"
    with pytest.raises(CheckpointError) as err:
        ctx.resume_state()
    assert len(set(COMM.allgather(str(err.value)))) == 1 and "world_size" in str(err.value), \
        str(err.value)
