"""Every parameter-server reply is θ at its version, bitwise, on every transport.

Three workers push concurrently (each at its own pace) to a server holding ~1 M parameters. The
server records a digest of θ at every version it creates (``on_push`` runs right after the reply to
that push was sent, before any other push is taken, so θ is the replied one); every worker records
the digest of every reply it got with the reply's version. Each worker digest must equal the
server's at that version: a stale, torn or mixed-up reply slot fails this (a planted bug that left
every other reply stale was caught: see ``test_a_stale_reply_is_caught``). With float buffers
(``extra``) a worker's slot is longer than θ, so rma's reply, written into the worker's gradient
slot (issue 13), must be read at ``worker · slot``: a planted read at ``worker · numel`` fails the
``extra=4099`` cases.
"""
from __future__ import annotations

import hashlib
import time

import pytest
import torch

from hpcasync.ps.server import PSServer
from hpcasync.ps.transport import make_transport
from hpcasync.rules import make_rule
from tests.mpi_util import COMM, RANK, SIZE

needs4 = pytest.mark.skipif(SIZE != 4, reason="needs 4 MPI ranks")

NUMEL = 1 << 20            # 1 M parameters (4 MiB per reply)
PUSHES = 12                # per worker


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _run(kind: str, break_every_other: bool = False, extra: int = 0) -> tuple[dict, list]:
    t = make_transport(kind, COMM, 0, NUMEL, extra=extra)
    theta0 = torch.linspace(-1, 1, NUMEL)
    rule = make_rule("asgd", theta0.clone(), t.num_workers, lr=0.01)
    seen: dict[int, str] = {}
    got: list[tuple[int, str]] = []
    if t.is_ps:
        seen[0] = _digest(rule.theta)
        server = PSServer(t, rule, pushes_per_epoch=None, epochs=None,
                          on_push=lambda w, tau, loss: seen.__setitem__(rule.version,
                                                                        _digest(rule.theta)))
        if break_every_other:                       # the planted bug: every other reply stale
            send, calls = t.send_reply, [0]

            def stale(w, params, *args):
                calls[0] += 1
                return send(w, theta0 if calls[0] % 2 == 0 else params, *args)
            t.send_reply = stale
        server.serve()
        server.finish()
    else:
        local = torch.empty(NUMEL)
        head = t.recv_reply(local)
        got.append((head.version, _digest(local)))
        g = torch.full((NUMEL,), 0.001 * (t.worker + 1))
        buffers = torch.full((extra,), 7.0 + t.worker)
        for s in range(PUSHES):
            time.sleep(0.002 * t.worker)            # different paces: replies interleave
            t.push(g, buffers, version=head.version, loss=1.0, last=s == PUSHES - 1)
            head = t.recv_reply(local)
            got.append((head.version, _digest(local)))
        t.wait_end()
        t.push(torch.zeros(0), kind=4, version=PUSHES)       # KIND_DONE
    t.close()
    return seen, got


def _check(seen_by_rank, got_by_rank) -> list[str]:
    seen = seen_by_rank[0]
    bad = []
    for r, got in enumerate(got_by_rank):
        for version, digest in got:
            if seen.get(version) != digest:
                bad.append(f"rank {r}: reply at version {version} is not θ at that version")
    return bad


@needs4
@pytest.mark.parametrize("extra", [0, 4099])
@pytest.mark.parametrize("kind", ["rma", "rma-put", "p2p"])
def test_every_reply_is_theta_at_its_version(kind, extra):
    seen, got = _run(kind, extra=extra)
    seen_all, got_all = COMM.gather(seen), COMM.gather(got)
    if RANK == 0:
        assert len(seen_all[0]) == 3 * PUSHES + 1               # every version was recorded
        assert sum(len(g) for g in got_all) == 3 * (PUSHES + 1)
        assert not _check(seen_all, got_all)


@needs4
def test_a_stale_reply_is_caught():
    """The check itself can fail: with every other reply replaced by the initial θ, it does."""
    seen, got = _run("rma", break_every_other=True)
    seen_all, got_all = COMM.gather(seen), COMM.gather(got)
    if RANK == 0:
        assert len(_check(seen_all, got_all)) >= PUSHES
