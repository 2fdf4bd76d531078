"""Deterministic sharding and batching, identical on every rank without any communication.

For epoch e, every process computes the same permutation π_e of ``0 .. L-1`` (``torch.randperm``
with a ``torch.Generator`` seeded with :func:`mix_seed` (seed, e)), then cuts it into S equal
contiguous parts of ``m = ⌊L / S⌋`` indices; shard s gets ``π_e[s·m : (s+1)·m]``::

    shard(s, e) = π_e[s·m : (s+1)·m],   m = ⌊L / S⌋

Example::

    sharder = Sharder(len(train), shard_index=rank, num_shards=world, seed=42)
    for epoch in range(epochs):
        for x, y in sharder.batches(train, epoch, batch_size=128):
            ...

Design: docs/design/data.md#sharding (dropped examples, shard numbering, resuming an epoch,
reproducibility).
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from hpcasync.errors import ConfigError

__all__ = ["mix_seed", "epoch_permutation", "shard_indices", "num_batches", "batches", "Sharder",
           "EpochShards", "ElasticSampler"]

_U32 = 2 ** 32
_MASK64 = 2 ** 64 - 1


def _check_int(value, what: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low \
            or (high is not None and value >= high):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ConfigError(f"{what} must be an integer {bound}, got {value!r}")
    return value


def mix_seed(seed: int, epoch: int) -> int:
    """Fold (seed, epoch) into the 32-bit seed of a torch CPU generator.

    torch's CPU generator (mt19937) keeps only the low 32 bits of its seed, so ``seed·2³² + e``
    would give every seed the same permutations. Instead the 64-bit word ``seed·2³² + e`` goes
    through SplitMix64's finaliser (Steele, Lea, Flood, OOPSLA 2014), a bijection with full
    avalanche, and its high 32 bits are the seed: two different pairs collide with probability 2⁻³².
    """
    z = (seed * _U32 + epoch + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 32


def epoch_permutation(length: int, *, seed: int, epoch: int) -> torch.Tensor:
    """π_e: a permutation of ``range(length)`` (int64), a function of (length, seed, epoch) only."""
    _check_int(length, "dataset length", 0)
    _check_int(seed, "seed", 0, _U32)
    _check_int(epoch, "epoch", 0, _U32)
    gen = torch.Generator(device="cpu").manual_seed(mix_seed(seed, epoch))
    return torch.randperm(length, generator=gen, dtype=torch.int64)


def shard_indices(length: int, *, shard_index: int, num_shards: int, seed: int, epoch: int,
                  ) -> torch.Tensor:
    """The indices of shard ``shard_index`` of ``num_shards`` in epoch ``epoch`` (see module doc).

    Args:
        length: data set size L (at least ``num_shards``).
        shard_index: this shard, ``0 <= shard_index < num_shards``.
        num_shards: number of equal shards S (the world size, or the number of PS workers).
        seed: shared seed, ``0 <= seed < 2**32``.
        epoch: epoch number, ``0 <= epoch < 2**32``.

    Returns:
        int64 tensor of ``L // S`` indices.
    """
    _check_int(num_shards, "number of shards", 1)
    _check_int(shard_index, "shard index", 0, num_shards)
    if length < num_shards:
        raise ConfigError(f"a data set of {length} examples cannot be split into "
                          f"{num_shards} shards")
    per = length // num_shards
    perm = epoch_permutation(length, seed=seed, epoch=epoch)
    return perm[shard_index * per:(shard_index + 1) * per].clone()


def num_batches(num_examples: int, batch_size: int, drop_last: bool = True) -> int:
    """Batches in a pass over ``num_examples``: ⌊n/b⌋ with ``drop_last``, else ⌈n/b⌉."""
    _check_int(batch_size, "batch size", 1)
    return num_examples // batch_size if drop_last else -(-num_examples // batch_size)


def batches(dataset, indices: torch.Tensor, batch_size: int, drop_last: bool = True, *,
            start_batch: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(x, y)`` for consecutive slices of ``indices``, from batch ``start_batch`` on.

    Args:
        dataset: anything with ``images`` and ``labels`` tensors (an ArrayDataset).
        indices: int64 index tensor, e.g. from :func:`shard_indices`.
        batch_size: examples per batch.
        drop_last: drop a final short batch (default True).
        start_batch: first batch to yield, ``0 <= start_batch <= num_batches`` (default 0).
    """
    indices = torch.as_tensor(indices, dtype=torch.int64)
    total = num_batches(len(indices), batch_size, drop_last)
    _check_int(start_batch, "start batch", 0, total + 1)   # checked now, not at the first next()
    return _iter_batches(dataset, indices, batch_size, start_batch, total)


def _iter_batches(dataset, indices, batch_size, start, stop):
    for b in range(start, stop):
        idx = indices[b * batch_size:(b + 1) * batch_size]
        yield dataset.images.index_select(0, idx), dataset.labels.index_select(0, idx)


class Sharder:
    """One shard of a data set across epochs: :func:`shard_indices` + :func:`batches` with the
    length, shard and seed fixed.

    Args:
        length: data set size.
        shard_index, num_shards: which of how many equal shards (validated here, once).
        seed: shared seed (default 0).
    """

    def __init__(self, length: int, *, shard_index: int, num_shards: int, seed: int = 0):
        _check_int(length, "dataset length", 0)
        _check_int(num_shards, "number of shards", 1)
        _check_int(shard_index, "shard index", 0, num_shards)
        _check_int(seed, "seed", 0, _U32)
        if length < num_shards:
            raise ConfigError(f"a data set of {length} examples cannot be split into "
                              f"{num_shards} shards")
        self.length, self.shard_index, self.num_shards, self.seed = \
            length, shard_index, num_shards, seed

    @property
    def shard_size(self) -> int:
        return self.length // self.num_shards

    def indices(self, epoch: int) -> torch.Tensor:
        return shard_indices(self.length, shard_index=self.shard_index,
                             num_shards=self.num_shards, seed=self.seed, epoch=epoch)

    def num_batches(self, batch_size: int, drop_last: bool = True) -> int:
        """The same on every shard, since all shards have ``shard_size`` examples."""
        return num_batches(self.shard_size, batch_size, drop_last)

    def batches(self, dataset, epoch: int, batch_size: int, drop_last: bool = True, *,
                start_batch: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if len(dataset) != self.length:
            raise ConfigError(f"sharder made for {self.length} examples, data set has "
                              f"{len(dataset)}")
        return batches(dataset, self.indices(epoch), batch_size, drop_last, start_batch=start_batch)

    def __repr__(self) -> str:
        return (f"Sharder(length={self.length}, shard_index={self.shard_index}, "
                f"num_shards={self.num_shards}, seed={self.seed})")


class EpochShards:
    """Every shard of one epoch, as a world that may shrink mid-epoch sees them.

    Built for S shards it holds exactly :func:`shard_indices` of each (so a run without failures
    trains on the same batches). :meth:`reshard` after ``done`` batches of every shard: the
    examples not yet trained on (every shard's rest, the dead ranks' included) are pooled in shard
    order and cut into equal contiguous shards for the survivors, the few left over (fewer than
    the survivors) dropped as the epoch's own remainder is. Computed alike on every rank, with no
    communication.

    Example::

        plan = EpochShards(len(train), num_shards=4, seed=42, epoch=1)
        plan = plan.reshard(17, num_shards=3, batch_size=32)   # rank 3 died after 17 batches
        for x, y in batches(train, plan.shards[rank], batch_size):
            ...
    """

    def __init__(self, length: int, *, num_shards: int, seed: int, epoch: int):
        self.shards = [shard_indices(length, shard_index=s, num_shards=num_shards, seed=seed,
                                     epoch=epoch) for s in range(num_shards)]

    def num_batches(self, batch_size: int) -> int:
        return num_batches(len(self.shards[0]), batch_size)

    def reshard(self, done: int, num_shards: int, batch_size: int) -> "EpochShards":
        """The rest of the epoch after ``done`` batches of ``batch_size``, over ``num_shards``."""
        _check_int(num_shards, "number of shards", 1)
        rest = torch.cat([s[done * batch_size:] for s in self.shards])
        per = len(rest) // num_shards
        out = EpochShards.__new__(EpochShards)
        out.shards = [rest[k * per:(k + 1) * per].clone() for k in range(num_shards)]
        return out


class ElasticSampler(torch.utils.data.Sampler):
    """A distributed sampler whose world may shrink mid-epoch and which resumes at a position
    (:mod:`hpcasync.elastic`; Horovod's ``ElasticSampler`` shape, without its padding).

    The epoch's order is π_e (:func:`epoch_permutation` of (seed, epoch); ``0..L-1`` without
    ``shuffle``). The position ``processed`` counts the samples of the epoch that the world has
    trained (every rank's batches, :meth:`record_batch` after each step). The rest of the epoch,
    ``r = π_e[processed:]``, is dealt round-robin to the S ranks in whole batches of B::

        rank k, batch j = [r[(j·B + i)·S + k] for i in range(B)],   j < ⌊len(r) / (S·B)⌋

    so batch j of all ranks together is the slice ``r[j·S·B : (j+1)·S·B]``: after n recorded
    steps the trained samples are exactly the prefix ``π_e[:processed]``, whatever sizes the
    world had. **Resuming** at a committed ``processed`` on another world (``set_world``) deals
    ``π_e[processed:]`` over the new ranks: across the epoch every sample is trained at most
    once, and all are trained but the tail left when the epoch ends (fewer than S·B samples, S
    the size at the end; what ``drop_last`` drops). Pure: no communication.

    Args:
        length: the data set (its ``len``) or its size L.
        batch_size: B, the batch size of every rank (the sampler yields whole batches only).
        rank, num_replicas: this rank and the world size (:meth:`set_world` changes them).
        seed: shared seed, ``0 <= seed < 2**32``; shuffle: permute each epoch (default True).
    """

    def __init__(self, length, *, batch_size: int, rank: int = 0, num_replicas: int = 1,
                 seed: int = 0, shuffle: bool = True):
        self.length = _check_int(length if isinstance(length, int) else len(length),
                                 "dataset length", 0)
        self.batch_size = _check_int(batch_size, "batch size", 1)
        self.seed = _check_int(seed, "seed", 0, _U32)
        self.shuffle = bool(shuffle)
        self.epoch, self.processed = 0, 0
        self.set_world(rank, num_replicas)

    def set_world(self, rank: int, num_replicas: int) -> None:
        """Deal the rest of the epoch over ``num_replicas`` ranks from here on."""
        _check_int(num_replicas, "number of replicas", 1)
        self.rank, self.num_replicas = _check_int(rank, "rank", 0, num_replicas), num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning."""
        self.epoch, self.processed = _check_int(epoch, "epoch", 0, _U32), 0

    def record_batch(self, batch_idx: int | None = None, batch_size: int | None = None) -> None:
        """One step of every rank is done: ``processed += B·S`` (Horovod's arguments accepted;
        a ``batch_size`` other than B is a one-line error: the position would be wrong)."""
        if batch_size is not None and batch_size != self.batch_size:
            raise ConfigError(f"record_batch(batch_size={batch_size}) but the sampler deals "
                              f"batches of {self.batch_size}")
        step = self.batch_size * self.num_replicas
        if self.processed + step > self.length:
            raise ConfigError(f"record_batch past the end of epoch {self.epoch}: {self.processed} "
                              f"+ {step} samples of {self.length}")
        self.processed += step

    def order(self) -> torch.Tensor:
        """π_e, the epoch's order."""
        if self.shuffle:
            return epoch_permutation(self.length, seed=self.seed, epoch=self.epoch)
        return torch.arange(self.length, dtype=torch.int64)

    @property
    def num_batches(self) -> int:
        """Batches left for every rank in this epoch."""
        return (self.length - self.processed) // (self.batch_size * self.num_replicas)

    def indices(self) -> torch.Tensor:
        """This rank's indices for the rest of the epoch (``num_batches`` whole batches)."""
        rest = self.order()[self.processed:]
        return rest[self.rank::self.num_replicas][:self.num_batches * self.batch_size].clone()

    def __iter__(self):
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return self.num_batches * self.batch_size

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed": self.processed, "seed": self.seed,
                "length": self.length, "batch_size": self.batch_size, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        """The position (epoch, processed) of ``state``; rank and world size are kept. A state of
        another data set, seed, batch size or order is a one-line error."""
        for k in ("seed", "length", "batch_size", "shuffle"):
            if k in state and state[k] != getattr(self, k):
                raise ConfigError(f"ElasticSampler state of {k}={state[k]!r}, this sampler has "
                                  f"{getattr(self, k)!r}")
        self.epoch, self.processed = int(state["epoch"]), int(state["processed"])
