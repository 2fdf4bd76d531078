"""A parameter-server checkpoint from a user's loop: :func:`hpcasync.save_checkpoint` on every rank.

Every ParameterServer holds one :class:`LoopCheckpoints` (``opt.checkpoints``). A worker's call
asks the server for the checkpoint of its label and trains on; the server, inside ``serve()``,
writes ONE file when every worker has asked for that label or has finished. Nothing waits.

How a request travels: the worker sends it (a synchronous send, completed later) and counts it in
every header it sends after (``wire``: the push header's request count). The server receives a
worker's requests from that worker alone, when a header says more were sent than it took: no probe
of any source (under ULFM, Open MPI 5.0.11, an operation on any source can go on failing with
MPI_ERR_PROC_FAILED_PENDING after a worker's death was acknowledged, and the server would hang:
docs/design/ps.md#loop-checkpoints). The worker's FINISH header counts its last requests.

Example (every rank)::

    found = hpcasync.load_checkpoint("ckpt", model, opt)      # None: a fresh start, said in the log
    start = found["epoch"] if found else 0
    if ctx.is_server: opt.serve()
    else:
        for epoch in range(start + 1, E + 1): ...; hpcasync.save_checkpoint("ckpt", model, opt, epoch=epoch)
        opt.finish()

Design: docs/design/ps.md#loop-checkpoints (what each part holds, the server's own call, restore).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..checkpoint import CheckpointManager
from ..errors import CheckpointError

log = logging.getLogger("hpcasync")

#: the MPI tag of a worker's checkpoint request (on the optimizer's communicator; the transports
#: use 4101-4106, the sharded epoch exchange its own)
TAG_REQUEST = 4121


class LoopCheckpoints:
    """One ParameterServer's checkpoints from a user's loop (docs/design/ps.md#loop-checkpoints):
    ``opt.checkpoints``.

    Holds what the protocol keeps between calls: a worker's requests in flight, a server's clock
    loaded by :meth:`restore` until ``serve()`` continues it, and the server's
    :class:`Collector` while it serves. Reads the optimizer's public state only."""

    def __init__(self, opt):
        self.opt = opt
        self.sends: list = []                  # worker: its requests not yet taken by the server
        self.resume_clock: dict | None = None  # server: a loaded clock, continued at serve()
        self.collector: Collector | None = None    # server: while (and after) it serves
        self.commits: dict[int, dict] = {}     # server: each worker's last commit it took

    # -- worker side ----------------------------------------------------------------------------

    def worker_part(self, epoch: int, step: int, extra: dict) -> dict:
        """What a worker contributes to a checkpoint: its position and its own state."""
        opt = self.opt
        return {"worker": opt.worker, "epoch": int(epoch), "step": int(step),
                "extra": dict(extra), "steps": int(opt.steps), "version": int(opt.version),
                "buffers": opt.flat.buffers.detach().cpu().clone(),
                "int_buffers": {n: b.detach().cpu().clone() for n, b in opt.int_buffers().items()},
                "optimizer": opt.state_dict(),
                "local": opt.local_model() if opt.keeps_local else None}

    def request(self, directory, *, epoch: int, step: int, keep: int, extra: dict,
                header: dict) -> None:
        """Worker: ask the server to write a checkpoint of this label
        (docs/design/ps.md#loop-checkpoints); returns at once."""
        opt = self.opt
        msg = {"directory": str(directory), "keep": int(keep), "label": (int(epoch), int(step)),
               "header": dict(header), "part": self.worker_part(epoch, step, extra)}
        if opt.finished:
            from ..errors import ConfigError

            raise ConfigError(f"{opt.algorithm} worker {opt.worker}: save_checkpoint after its "
                              "last message to the server (opt.finish(), or the server's stop): "
                              "the server would never take it; save before")
        L = opt.layout
        for shard, transport in enumerate(opt.transports):    # every shard server writes its own
            sent = msg if shard == 0 else {**msg, "part": _position(msg["part"])}
            self.sends.append(opt.comm.issend(sent, dest=L.servers[shard], tag=TAG_REQUEST))
            transport.requests += 1    # its next header says so: the server receives it then

    def send_commit(self, values: dict) -> None:
        """Worker, at ``hpcasync.elastic.State.commit()`` under grow-back: its committed values
        (plain values, sampler, no tensors of the model) to the server, on the requests' way
        (counted in its next header), with its step count: a replacement resumes from the last
        one the server took. Nothing after the server's stop (the server takes no more)."""
        opt = self.opt
        if opt.finished:
            return
        self.sends = [r for r in self.sends if not r.Test()]
        self.sends.append(opt.comm.issend({"commit": values, "steps": int(opt.steps)},
                                          dest=opt.ps_rank, tag=TAG_REQUEST))
        opt.transport.requests += 1

    def flush(self) -> None:
        """Worker, after its FINISH header (which counts every request): wait until the server
        has taken them (it receives them when it reads that header)."""
        from .wire import wait

        sends, self.sends = self.sends, []
        for req in sends:
            wait(req)

    # -- server side ----------------------------------------------------------------------------

    def attach(self, server) -> "Collector":
        """Server, at ``serve()``: continue a loaded clock, take each worker's requests when its
        header counts them, and write complete labels between messages. Returns the collector
        (``close()`` it when ``serve`` returns)."""
        opt = self.opt
        clock, self.resume_clock = self.resume_clock, None
        if clock is not None:
            server.load_state_dict({**clock["server"], "rule": opt.rule.state_dict()})
            W = opt.num_workers
            server.finished = [False] * W            # a user's loop: every worker finishes itself
            server.positions = [int(p) for p in clock["positions"]]
            log.info("PS %s: resuming the server's clock at %d accepted pushes (epoch %d)",
                     opt.algorithm, server.stats.accepted, server.next_epoch)
        collector = self.collector = Collector(self, server)
        stop = server.stop_requested

        def stop_requested() -> bool:       # the loop's top: a finish or a death may complete one
            if collector.pending:
                collector.complete()
            return stop is not None and stop()
        server.stop_requested, server.on_header = stop_requested, collector.take
        return collector

    def snapshot(self, epoch: int, step: int, extra: dict, parts: dict | None) -> dict:
        """The server's state (θ in the model, the rule, the clock) and the workers' parts."""
        opt = self.opt
        opt.load_theta()
        self._mean_int_buffers(parts)
        clock = None
        if opt.server is not None:
            clock = {k: v for k, v in opt.server.state_dict().items() if k != "rule"}
        return {"model": opt.flat.module.state_dict(), "optimizer": opt.state_dict(),
                "epoch": int(epoch), "step": int(step), "extra": dict(extra),
                "ps": {"clock": clock, "workers": {str(w): p for w, p in (parts or {}).items()}}}

    def _mean_int_buffers(self, parts: dict | None) -> None:
        """Server: its model's integer buffers (``num_batches_tracked``, a counter of the
        user's), which no push carries, take the mean of the workers' parts (rounded down)."""
        saved = [p["int_buffers"] for p in (parts or {}).values()
                 if p is not None and p.get("int_buffers")]
        for name, buf in self.opt.int_buffers().items():
            values = [s[name] for s in saved if name in s and s[name].shape == buf.shape]
            if values:
                mean = torch.div(torch.stack([v.to(torch.int64) for v in values]).sum(0),
                                 len(values), rounding_mode="floor")
                buf.copy_(mean.to(buf))

    def write(self, directory, epoch: int, step: int, *, keep: int, extra: dict,
              parts: dict | None, header: dict) -> Path:
        """Server: write :meth:`snapshot` atomically to ``directory``; returns the path."""
        from .shards import shard_snapshot

        opt = self.opt
        state = self.snapshot(epoch, step, extra, parts)
        path = shard_snapshot(opt, CheckpointManager(directory, keep=keep), state, epoch=epoch,
                              step=step, header=header)
        log.info("PS %s: checkpoint %s (%s)", opt.algorithm, path,
                 f"every worker's part, version {opt.rule.version}" if parts else
                 f"the server's state only, version {opt.rule.version}")
        return path

    def save(self, directory, *, epoch: int, step: int, keep: int, extra: dict,
             header: dict) -> Path:
        """The server's own ``save_checkpoint`` (inside ``on_epoch`` or after ``serve()``): a
        server-only file, unless the workers already completed this label (then that file)."""
        if self.collector is not None:
            self.collector.complete()
            done = self.collector.written.get((int(epoch), int(step)))
            if done is not None:
                return done
        return self.write(directory, epoch, step, keep=keep, extra=extra, parts=None,
                          header=header)

    # -- loading --------------------------------------------------------------------------------

    def restore(self, state: dict) -> dict:
        """Load a PS checkpoint's state into the optimizer (its model already holds
        ``state["model"]``); returns the position the loop continues from (``{"epoch", "step",
        **extra}``; a worker that had finished: ``finished: True``)."""
        opt = self.opt
        _check_cut(opt, state)
        opt.load_state_dict(state["optimizer"])
        ps = state.get("ps") or {}
        parts = {int(w): p for w, p in (ps.get("workers") or {}).items()}
        position = {"epoch": state["epoch"], "step": state["step"], **state.get("extra", {})}
        if opt.is_server:
            if ps.get("clock") is not None:
                positions = [int(parts[w]["steps"]) if w in parts else 0
                             for w in range(opt.num_workers)]
                self.resume_clock = {"server": ps["clock"], "positions": positions}
            return position
        part = parts.get(opt.worker)
        if part is None:
            if opt.keeps_local:
                log.warning("%s worker %d: the checkpoint holds no model of its own (the server "
                            "wrote it alone): it restarts from the server's θ", opt.algorithm,
                            opt.worker)
            return position
        if "optimizer" in part:
            buffers = part["buffers"]
            if buffers.numel() != opt.flat.buffers.numel():
                raise CheckpointError(f"worker {opt.worker}'s saved buffers have "
                                      f"{buffers.numel()} elements, the model "
                                      f"{opt.flat.buffers.numel()}")
            opt.flat.buffers.copy_(buffers.to(opt.flat.buffers))
            mine = opt.int_buffers()
            for name, value in (part.get("int_buffers") or {}).items():
                if name in mine and value.shape == mine[name].shape:
                    mine[name].copy_(value.to(mine[name]))
            opt.load_state_dict(part["optimizer"])
            opt.steps = int(part["steps"])
            if part.get("local") is not None:
                opt.resume_local(part["local"])
        out = {"epoch": part["epoch"], "step": part["step"], **part.get("extra", {})}
        if part.get("finished"):
            out["finished"] = True
        return out


class Collector:
    """Server: the workers' checkpoint requests, written when a label is complete
    (docs/design/ps.md#loop-checkpoints)."""

    def __init__(self, checkpoints: LoopCheckpoints, server):
        self.checkpoints, self.opt, self.server = checkpoints, checkpoints.opt, server
        self.pending: dict[tuple[int, int], dict] = {}
        self.written: dict[tuple[int, int], Path] = {}
        self.last: dict[int, dict] = {}          # each worker's latest part
        self.received = [0] * self.opt.num_workers     # requests taken from each worker

    def take(self, push) -> None:
        """A header from worker ``push.worker`` (``PSServer.on_header``, before the message is
        handled): receive, from that worker alone, the requests it counts and this server has not
        taken; write the labels that are complete. A dead worker: ``WorkerFailed``."""
        w = push.worker
        if w in self.server.failed or push.requests <= self.received[w]:
            return
        transport = self.opt.transport
        from mpi4py import MPI

        while self.received[w] < push.requests:
            try:
                msg = self.opt.comm.recv(source=self.opt.layout.workers[w], tag=TAG_REQUEST)
            except MPI.Exception as exc:
                raise transport._failed(exc) from None
            self.received[w] += 1
            if "commit" in msg:         # a worker's commit (grow-back: send_commit)
                self.checkpoints.commits[w] = msg
                continue
            label, part = tuple(msg["label"]), msg["part"]
            entry = self.pending.setdefault(label, {**msg, "parts": {}})
            entry["parts"][part["worker"]] = part
            self.last[part["worker"]] = part
        self.complete()

    def _done(self, w: int) -> bool:
        return bool(self.server.finished[w]) or w in self.server.failed

    def complete(self) -> None:
        """Write every pending label that every worker has asked for or finished before."""
        W = self.opt.num_workers
        for label in sorted(self.pending):
            entry = self.pending[label]
            if all(w in entry["parts"] or self._done(w) for w in range(W)):
                del self.pending[label]
                parts = {w: entry["parts"].get(w) or _finished_part(self.last.get(w), label,
                                                                     self.server.positions[w])
                         for w in range(W)}
                self.written[label] = self.checkpoints.write(
                    entry["directory"], *label, keep=entry["keep"], extra={}, parts=parts,
                    header=entry["header"])

    def close(self) -> None:
        """After ``serve()``: every worker has finished (its FINISH header counted its last
        requests, taken then), so every pending label is complete."""
        self.complete()


def _finished_part(last: dict | None, label, position: int) -> dict:
    """The part of a worker that finished before asking for ``label``: its latest, flagged."""
    if last is None:
        return {"epoch": label[0], "step": label[1], "extra": {}, "steps": int(position),
                "finished": True}
    return {**last, "finished": True}


def _position(part: dict) -> dict:
    """A worker's part as a shard server other than shard 0 keeps it: its position alone (its
    own state is in shard 0's file)."""
    return {k: part[k] for k in ("worker", "epoch", "step", "steps")} | {"extra": {}}


def _check_cut(opt, state: dict, where=None) -> None:
    """One line (starting with the file ``where``, if given) when a checkpoint was cut over
    another number of servers, at other bounds, or is another shard's."""
    L = opt.layout
    try:
        if state.get("ps_ranks", 1) != L.K:
            raise CheckpointError(f"checkpoint was written by {state.get('ps_ranks', 1)} server "
                                  f"ranks (ps_ranks), this optimizer has {L.K}")
        if L.K > 1:
            from .shards import check_bounds

            check_bounds(L, state)
            if state.get("shard") != max(L.shard, 0):
                raise CheckpointError(f"checkpoint holds shard {state.get('shard')}'s state, "
                                      "this rank " + (f"serves shard {L.shard}" if L.shard > 0
                                                      else "reads shard 0"))
    except CheckpointError as exc:
        if where is None:
            raise
        raise CheckpointError(f"{where}: {exc}") from None


def read_sharded(opt, directory, expect: dict | None) -> tuple | None:
    """Shard servers (``ps_ranks`` K > 1), collective over ``opt.comm``: ``(path, header,
    state)`` of the newest label that every shard server wrote intact, each rank's own file of
    it (shard s's server: ``directory/shard-s``; shard 0's server and every worker: shard 0's, in
    ``directory``), or None where there is none. Each server writes a label when every worker
    has asked for it, so their newest labels can differ: the newest common one is taken. A file
    that does not fit (another algorithm, model, or cut) is one line on every rank."""
    from ..checkpoint import _check_expected, read_checkpoint

    L, base = opt.layout, Path(directory)
    mine = base / f"shard-{L.shard}" if L.shard > 0 else base
    listed = opt.comm.allgather((L.shard, [p.name for p in CheckpointManager(mine).checkpoints()]))
    names = {shard: held for shard, held in listed if shard >= 0}
    for name in names[0]:
        if not all(name in held for held in names.values()):
            continue
        got, error = None, None
        try:
            header, state = read_checkpoint(mine / name)
        except CheckpointError as exc:
            log.warning("skipping %s", exc)
        else:
            try:
                _check_expected(mine / name, header, expect)      # (its line names the file)
                _check_cut(opt, state, where=mine / name)
                got = (mine / name, header, state)
            except CheckpointError as exc:
                error = str(exc)
        verdicts = opt.comm.allgather((got is not None, error))
        errors = [e for _, e in verdicts if e]
        if errors:
            raise CheckpointError(errors[0])
        if all(ok for ok, _ in verdicts):
            return got
    error = None            # none in common: shard 0's newest says whether it was cut so
    if names[0] and opt.comm.Get_rank() == L.servers[0]:
        try:
            found = CheckpointManager(base).load_latest(expect=expect)
            if found is not None:
                _check_cut(opt, found[2])
            log.warning("%s holds checkpoints of shard 0 but none that all %d shard servers "
                        "wrote intact (shard-1/ ... beside them): starting from the beginning",
                        base, L.K)
        except CheckpointError as exc:
            error = str(exc)
    error = opt.comm.bcast(error, root=L.servers[0])
    if error:
        raise CheckpointError(error)
    return None
