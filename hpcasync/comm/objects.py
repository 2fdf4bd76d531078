"""Python objects over MPI with their tensors as buffers: a state of any size.

mpi4py's ``comm.bcast(obj)``/``comm.gather(obj)`` pickle the object into one message whose byte
count MPI takes as an ``int``. Open MPI 5 refuses a count over 2**31 - 1 (``MPI_ERR_ARG``), also
through the large-count calls mpi4py makes then: a model or an optimizer state over 2 GiB (a
model past ~540M float32 parameters, Adam's moments past ~270M) could not be synchronized,
checkpointed or broadcast from a checkpoint. Here the object is pickled with every tensor of at
least :data:`OUT_OF_BAND` bytes left out (a reference in its place), and those tensors travel as
raw bytes in pieces of at most :data:`PIECE` bytes (:func:`bcast_bytes`), as the object itself
does when its pickle is large. Design: docs/design/comm.md, "Messages over 2 GiB".

Example::

    state = bcast_object(comm, model.state_dict() if comm.Get_rank() == 0 else None, root=0)
    parts = gather_object(comm, opt.local_state_dict(), root=0)     # a list on rank 0
    every = allgather_object(comm, opt.local_state_dict())          # a list on every rank
"""
from __future__ import annotations

import io
import pickle

import numpy as np
import torch

#: bytes per MPI call (a count MPI takes as an int, far from its limit)
PIECE = 1 << 30
#: a tensor of at least this many bytes travels as a buffer; a pickle up to it inside the header
OUT_OF_BAND = 1 << 16


def bcast_bytes(comm, buf: np.ndarray, root: int) -> None:
    """``root``'s bytes into ``buf`` (a contiguous uint8 array of the same size everywhere), in
    pieces of at most :data:`PIECE`. Collective over ``comm``."""
    for start in range(0, buf.size, PIECE):
        comm.Bcast(buf[start:start + PIECE], root=root)


def bcast_object(comm, obj, root: int = 0, *, copy: bool = False):
    """``root``'s ``obj`` on every rank of ``comm`` (collective), any size. On ``root`` the
    result is ``obj`` itself, or with ``copy`` a copy (as a pickled broadcast gives)."""
    me = comm.Get_rank()
    sent = _dumps(obj) if me == root else None
    head = comm.bcast(_header(*sent) if me == root else None, root=root)
    got = _bcast_parts(comm, head, root, sent, copy=me != root or copy)
    return obj if me == root and not copy else got


def _bcast_parts(comm, head, root: int, sent=None, *, copy: bool = True):
    """The rest of ``root``'s object after its header ``head`` (:func:`_header`): its large
    pickle and tensors broadcast from it in pieces (collective), then the object unpickled.
    ``sent``: on ``root``, its :func:`_dumps`; there, without ``copy``, nothing is made and
    None is returned."""
    if isinstance(head[0], bytes):
        blob = head[0]
    else:                               # a large pickle follows as bytes
        blob = np.frombuffer(sent[0], np.uint8) if sent else np.empty(head[0], np.uint8)
        bcast_bytes(comm, blob, root)
    tensors = []
    for i, meta in enumerate(head[1]):
        tensor, raw = _empty(meta) if copy else (None, None)
        if sent:
            bcast_bytes(comm, sent[1][i][1], root)
            if copy:
                raw[:] = sent[1][i][1]
        else:
            bcast_bytes(comm, raw, root)
        tensors.append(_finish(meta, tensor) if copy else None)
    return _loads(blob, tensors) if copy else None


def gather_object(comm, obj, root: int = 0) -> list | None:
    """Every rank's ``obj`` on ``root`` (a list in rank order, ``obj`` itself at ``root``'s
    place), None elsewhere; collective over ``comm``, any size: a rank's large parts come in
    pieces of at most :data:`PIECE` bytes through ``MPI_Gatherv`` (the other ranks send none)."""
    from mpi4py import MPI

    me, size = comm.Get_rank(), comm.Get_size()
    blob, items = _dumps(obj) if me != root else (b"", [])     # (the root keeps its own)
    own = _header(blob, items)
    heads = comm.gather(own, root=root)
    # who sends how many bytes, the same calls on every rank: from the root
    plan = comm.bcast(None if me != root else [
        ([] if isinstance(h[0], bytes) else [h[0]]) + [_nbytes(m) for m in h[1]]
        for h in heads], root=root)
    mine = ([] if isinstance(own[0], bytes) else [np.frombuffer(blob, np.uint8)]) + [
        data for _, data in items]
    out = [obj] if me == root else None
    for r, sizes in enumerate(plan):
        if me == root and r != root:
            head = heads[r]
            made = [_empty(m) for m in head[1]]
            recv = ([] if isinstance(head[0], bytes) else [np.empty(head[0], np.uint8)]) + [
                raw for _, raw in made]
        for k, n in enumerate(sizes):
            for start in range(0, n, PIECE):
                count, counts = min(PIECE, n - start), [0] * size
                counts[r] = count
                send = mine[k][start:start + count] if me == r else np.empty(0, np.uint8)
                comm.Gatherv([send, MPI.BYTE], None if me != root else
                             [recv[k][start:start + count], counts, [0] * size, MPI.BYTE],
                             root=root)
        if me == root and r != root:
            out.insert(r, _loads(head[0] if isinstance(head[0], bytes) else recv[0],
                                 [_finish(m, t) for m, (t, _) in zip(head[1], made)]))
    return out


def allgather_object(comm, obj) -> list:
    """Every rank's ``obj`` on every rank of ``comm`` (a list in rank order, each a copy, its
    own too, as a pickled allgather gives); collective, any size: the small parts in one
    allgather, each rank's large parts then broadcast from it in pieces of at most
    :data:`PIECE` bytes."""
    me = comm.Get_rank()
    sent = _dumps(obj)
    return [_bcast_parts(comm, head, r, sent if r == me else None)
            for r, head in enumerate(comm.allgather(_header(*sent)))]


# -- pickling with the large tensors left out --------------------------------------------------
class _Pickler(pickle.Pickler):
    def __init__(self, file, items: list):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.items, self.index = items, {}

    def persistent_id(self, obj):
        if not _out_of_band(obj):
            return None
        i = self.index.get(id(obj))
        if i is None:
            host = obj.detach().resolve_conj().resolve_neg().cpu().contiguous()
            meta = (obj.dtype, tuple(obj.shape), str(obj.device), obj.requires_grad,
                    type(obj) is torch.nn.Parameter)
            i = self.index[id(obj)] = len(self.items)
            self.items.append((meta, host.reshape(-1).view(torch.uint8).numpy(), obj))
        return i


def _out_of_band(obj) -> bool:
    return (type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.layout == torch.strided
            and not obj.is_quantized and not obj.is_nested and obj.device.type != "meta"
            and obj.numel() * obj.element_size() >= OUT_OF_BAND)


def _dumps(obj) -> tuple[memoryview, list]:
    """``obj`` pickled without its large tensors (a writable buffer: MPI may send from it),
    and those as ``(meta, uint8 array)``."""
    items: list = []
    f = io.BytesIO()
    _Pickler(f, items).dump(obj)
    return f.getbuffer(), [(meta, data) for meta, data, _ in items]


def _loads(blob, tensors: list):
    up = pickle.Unpickler(io.BytesIO(blob))
    up.persistent_load = tensors.__getitem__
    return up.load()


def _header(blob, items: list) -> tuple:
    """The pickle itself when small, else its length (its bytes follow); the tensors' metas."""
    return (bytes(blob) if len(blob) <= OUT_OF_BAND else len(blob), [m for m, _ in items])


def _nbytes(meta) -> int:
    return int(np.prod(meta[1], dtype=np.int64)) * meta[0].itemsize


def _empty(meta) -> tuple[torch.Tensor, np.ndarray]:
    t = torch.empty(meta[1], dtype=meta[0])
    return t, t.reshape(-1).view(torch.uint8).numpy()


def _finish(meta, tensor: torch.Tensor) -> torch.Tensor:
    """The received host tensor on the sender's device, with its ``requires_grad`` and type."""
    _, _, device, requires_grad, parameter = meta
    if device != "cpu":
        tensor = tensor.to(device)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor
