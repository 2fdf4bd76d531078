"""The parameter server's memory (``hpcasync.ps.memory``, issue 13): what each transport reports is
what it allocated, the pure formula the simulator uses is what the real transports hold on real
ranks, the run records carry it, and p2p's shared reply copies are bitwise θ. (The formula by
hand and the report's columns, one process: tests/unit/test_ps_memory.py.)

* Allocation: the windows' sizes as MPI reports them (``Win.Get_attr(WIN_SIZE)``, the length of
  ``Win.tomemory()``), p2p's tensors' storage bytes.
* Sharing (p2p): the PS sends replies while the workers have not posted their receives (a barrier
  holds them; 4 MiB messages stay in flight until received), so the copies alive can be counted;
  each reply is then checked bitwise. Same version + same object modified in place, and 0.0 vs
  -0.0 (equal as floats, not as bits), must not share.

Planted bugs each fails (see the report of issue 13): sharing by version alone; identity without
the in-place version counter; ``torch.equal`` instead of a bitwise test; reusing a copy whose send
is still in flight; a ``state_bytes`` without the reply copies; rma's reply read at
``worker · numel`` instead of ``worker · slot`` (tests/mpi/test_ps_replies.py with buffers).
"""
from __future__ import annotations

import hashlib

import pytest
import torch
from mpi4py import MPI

from hpcasync.ps.memory import transport_bytes, worker_transport_bytes
from hpcasync.ps.server import PSServer
from hpcasync.ps.transport import KIND_DONE, TRANSPORTS, make_transport
from hpcasync.rules import make_rule
from tests.mpi_util import COMM, RANK, SIZE, idle_barrier, last_summary, run_cli, run_mpi

needs4 = pytest.mark.skipif(SIZE != 4, reason="needs 4 MPI ranks (PS + 3 workers)")

NUMEL, EXTRA = 1000, 37


def _allocated(t) -> int:
    """What this rank's transport really holds: MPI's window sizes, or the tensors' storages."""
    if t.name.startswith("rma"):
        total = 0
        for win in (t.win_in, t.win_out):
            if win is not None:
                size = win.Get_attr(MPI.WIN_SIZE)
                assert size == len(win.tomemory())
                total += size
        return total
    bufs = [] if t.pool is None else [c.buf for c in t.pool._live] + list(t.pool._spare)
    return t._grad.untyped_storage().nbytes() + sum(b.untyped_storage().nbytes() for b in bufs)


def _digest(x: torch.Tensor) -> str:
    return hashlib.sha256(x.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@needs4
@pytest.mark.parametrize("kind", TRANSPORTS)
def test_reported_bytes_are_the_allocation_and_the_formula(kind):
    t = make_transport(kind, COMM, 0, NUMEL, extra=EXTRA)
    got = (t.state_bytes(), _allocated(t), t.bound_bytes(), t.peak_bytes)
    expect = (transport_bytes(kind, 3, NUMEL, EXTRA, reply_buffers=0) if t.is_ps
              else worker_transport_bytes(kind, NUMEL, EXTRA))
    bound = transport_bytes(kind, 3, NUMEL, EXTRA) if t.is_ps else expect
    t.close()
    after = t.state_bytes()
    assert got == (expect, expect, bound, expect), (RANK, got, expect)
    assert after == 0
    if t.is_ps:
        assert expect == (3 if kind != "p2p" else 1) * (NUMEL + EXTRA) * 4


@needs4
@pytest.mark.parametrize("kind", TRANSPORTS)
def test_a_run_records_its_memory(kind):
    """A real exchange (asgd, 3 workers with float buffers): rma holds exactly its bound, p2p at
    least one reply copy and at most its bound; the record's total is the sum of its parts."""
    t = make_transport(kind, COMM, 0, NUMEL, extra=EXTRA)
    out = None
    if t.is_ps:
        rule = make_rule("asgd", torch.zeros(NUMEL), 3, lr=0.1)
        server = PSServer(t, rule, pushes_per_epoch=None, epochs=None)
        server.serve()
        server.finish()
        out = (t.memory_record(rule.state_bytes()), t.state_bytes(), _allocated(t),
               rule.state_bytes())
    else:
        local = torch.empty(NUMEL)
        head = t.recv_reply(local)
        for s in range(6):
            t.push(torch.full((NUMEL,), 0.01), torch.ones(EXTRA), version=head.version,
                   loss=1.0, last=s == 5)
            head = t.recv_reply(local)
        t.wait_end()
        t.push(torch.zeros(0), kind=KIND_DONE, version=6)
    t.close()
    if out is not None:
        rec, now, allocated, rule_bytes = out
        slot = (NUMEL + EXTRA) * 4
        assert now == allocated
        assert rec["ps_transport_bytes"] == transport_bytes(kind, 3, NUMEL, EXTRA)
        assert rec["ps_buffers_bytes"] == 3 * EXTRA * 4 and rec["ps_state_bytes"] == rule_bytes
        assert rec["ps_total_bytes"] == rule_bytes + rec["ps_transport_bytes"] + 3 * EXTRA * 4
        if kind == "p2p":
            assert slot + NUMEL * 4 <= rec["ps_transport_peak_bytes"] <= rec["ps_transport_bytes"]
        else:
            assert rec["ps_transport_peak_bytes"] == rec["ps_transport_bytes"] == 3 * slot


BIG = 1 << 20                         # 4 MiB replies: a send stays in flight until received


@needs4
def test_p2p_shares_only_bitwise_equal_replies():
    t = make_transport("p2p", COMM, 0, BIG)
    theta = torch.linspace(-1, 1, BIG)
    zero = torch.zeros(BIG)
    counts, got = [], []
    if t.is_ps:
        orig = theta.clone()
        for w in range(3):                          # A: one object, one version -> one copy
            t.send_reply(w, theta, 0, True)
        counts.append((t.pool.buffers, t.state_bytes(), _allocated(t)))
        idle_barrier()
        idle_barrier()
        t.send_reply(0, theta, 7, True)             # B: the same object at the same version,
        theta.add_(1.0)                             #    modified in place -> a second copy
        t.send_reply(1, theta, 7, True)
        t.send_reply(2, theta.clone(), 7, True)     #    another object, same bits -> shared
        counts.append((t.pool.buffers, t.state_bytes(), _allocated(t)))
        idle_barrier()
        idle_barrier()
        t.send_reply(0, zero, 9, True)              # C: 0.0 vs -0.0: equal floats, other bits
        t.send_reply(1, -zero, 9, True)
        t.send_reply(2, zero.clone(), 9, True)
        counts.append((t.pool.buffers, t.state_bytes(), _allocated(t)))
        idle_barrier()
        idle_barrier()
        shared, copies, peak = t.pool.shared, t.pool.copies, t.peak_bytes
        want = {0: [_digest(orig), _digest(orig), _digest(zero)],
                1: [_digest(orig), _digest(theta), _digest(-zero)],
                2: [_digest(orig), _digest(theta), _digest(zero)]}
    else:
        local = torch.empty(BIG)
        for _ in range(3):               # a round's replies are received only after the
            idle_barrier()               # server counted its copies, and the next round starts
            head = t.recv_reply(local)   # only after they were (one barrier: MPICH sometimes
            got.append((head.version, _digest(local)))    # still held round A's copy in B)
            idle_barrier()
    t.close()
    got_all = COMM.gather(got)
    if RANK == 0:
        one = transport_bytes("p2p", 3, BIG, reply_buffers=1)
        two = transport_bytes("p2p", 3, BIG, reply_buffers=2)
        for w in range(3):                          # first: every reply is what was sent
            versions = [v for v, _ in got_all[w + 1]]
            digests = [d for _, d in got_all[w + 1]]
            assert versions == [0, 7, 9]
            bad = [r for r, (a, b) in enumerate(zip(digests, want[w])) if a != b]
            assert not bad, f"worker {w}: replies of rounds {bad} are not what was sent"
        assert counts == [(1, one, one), (2, two, two), (2, two, two)]
        assert (shared, copies, peak) == (2 + 1 + 1, 1 + 2 + 2, two)


@pytest.mark.rank0
@pytest.mark.one_mpi       # the MPI run's record: test_a_run_records_its_memory, under every MPI
@pytest.mark.parametrize("algorithm, kind", [("smega2", "p2p")])
def test_simulator_reports_the_memory_of_the_mpi_run(algorithm, kind, tmp_path):
    """ResNet-20 (with BatchNorm buffers), 3 workers: the simulator's memory fields are the MPI
    run's (the pure formula vs the real transport), and they are the formula's values."""
    from hpcasync.comm import FlatModel
    from hpcasync.models import build_model

    common = ["--algorithm", algorithm, "--model", "resnet20", "--dataset", "fashion-mnist-mini",
              "--train-limit", "192", "--test-limit", "64", "--epochs", "1", "--batch-size", "32",
              "--progress", "off", "--ps-transport", kind]
    mpi, sim = tmp_path / "mpi.jsonl", tmp_path / "sim.jsonl"
    a = run_mpi(4, ["train", *common, "--metrics", str(mpi)], timeout=240)
    assert a.returncode == 0, a.stderr[-2000:]
    b = run_cli(["sim", "--workers", "3", *common, "--metrics", str(sim)], timeout=240)
    assert b.returncode == 0, b.stderr[-2000:]
    ours, theirs = last_summary(mpi), last_summary(sim)
    keys = ("ps_state_bytes", "ps_transport_bytes", "ps_buffers_bytes", "ps_total_bytes")
    assert {k: ours[k] for k in keys} == {k: theirs[k] for k in keys}
    flat = FlatModel(build_model("resnet20", (1, 28, 28), 10))
    n, e = flat.numel, flat.buffer_numel
    assert e > 0
    assert ours["ps_transport_bytes"] == transport_bytes(kind, 3, n, e)
    assert ours["ps_buffers_bytes"] == 3 * e * 4
    assert ours["ps_total_bytes"] == ours["ps_state_bytes"] + ours["ps_transport_bytes"] + 3 * e * 4
    peak = ours["ps_transport_peak_bytes"]
    if kind == "p2p":                       # the receive buffer and at least one reply copy
        assert (n + e) * 4 + n * 4 <= peak <= ours["ps_transport_bytes"]
    else:
        assert peak == ours["ps_transport_bytes"]
    assert "ps_transport_peak_bytes" not in theirs
