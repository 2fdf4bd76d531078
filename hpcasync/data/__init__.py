"""Data layer: strict readers (IDX, CIFAR-10 without executing pickles), the data set registry and
deterministic per-shard batching. Pure numpy/torch; no MPI here -- ranks pass their shard number.
``load_dataset`` also takes user code, ``MODULE:FACTORY`` (see :mod:`hpcasync.plugins`).

Example::

    from hpcasync.data import load_dataset, Sharder
    train, test = load_dataset("fashion-mnist")
    sharder = Sharder(len(train), shard_index=rank, num_shards=world, seed=0)
    for x, y in sharder.batches(train, epoch=0, batch_size=64):
        ...
"""
from hpcasync.data.cifar import read_bin_batch, read_cifar10_dir, read_pickle_batch, safe_unpickle
from hpcasync.data.datasets import (DATASETS, NORMALIZATION, ArrayDataset, load_dataset,
                                    locate_dataset,
                                    make_mini_set, normalize_images)
from hpcasync.data.idx import read_idx, read_idx_pair, write_idx
from hpcasync.data.sharding import (EpochShards, Sharder, batches, epoch_permutation, mix_seed, num_batches,
                                    shard_indices)

__all__ = ["ArrayDataset", "DATASETS", "EpochShards", "NORMALIZATION", "Sharder", "batches", "epoch_permutation",
           "load_dataset", "locate_dataset", "make_mini_set", "mix_seed", "normalize_images", "num_batches",
           "read_bin_batch", "read_cifar10_dir", "read_idx", "read_idx_pair", "read_pickle_batch",
           "safe_unpickle", "shard_indices", "write_idx"]
