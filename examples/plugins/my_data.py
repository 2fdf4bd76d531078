"""A data set as a user of ``hpcasync train --dataset MODULE:FACTORY`` writes it.

A data factory is called with no arguments and returns ``(train, test)``: two map-style
``torch.utils.data.Dataset`` objects whose items are ``(tensor, int label)``. Any item shape and
any number of classes will do; hpcasync reads the items once, at load, into memory::

    cd examples/plugins
    MY_DATA_LIMIT=4000 mpiexec -n 4 hpcasync train --model my_models:gru --dataset my_data:rows
"""
from __future__ import annotations

import os

import numpy as np
import torch
from torch.utils.data import TensorDataset

from hpcasync.data import load_dataset


def rows():
    """Fashion-MNIST (the built-in 6000/1000 subset when the full set is not installed) as
    (28, 28) float32 images, one row per GRU step, with int64 labels. ``MY_DATA_LIMIT=N`` keeps
    the first N training images (default: all)."""
    limit = os.environ.get("MY_DATA_LIMIT")
    train, test = load_dataset("fashion-mnist", train_limit=int(limit) if limit else None)
    out = []
    for split in (train, test):
        images = split.images.numpy().reshape(-1, 28, 28).astype(np.float32)
        labels = split.labels.numpy().astype(np.int64)
        out.append(TensorDataset(torch.from_numpy(images), torch.from_numpy(labels)))
    return out[0], out[1]
