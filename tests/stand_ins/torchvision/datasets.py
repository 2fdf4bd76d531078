"""``torchvision.datasets.MNIST`` stand-in (package docstring: it serves Fashion-MNIST)."""
from __future__ import annotations

import os

import torch

from hpcasync.data.datasets import IDX_FILES, _idx_path, locate_dataset
from hpcasync.data.idx import read_idx_pair


class MNIST(torch.utils.data.Dataset):
    """``MNIST(root, train=True, transform=None, target_transform=None, download=False)``:
    ``(image, label)`` pairs, image a 28x28 ``uint8`` tensor before ``transform``."""

    def __init__(self, root=None, train: bool = True, transform=None, target_transform=None,
                 download: bool = False):
        directory, _ = locate_dataset("fashion-mnist", warn=False)
        img, lab = (_idx_path(directory, stem) for stem in IDX_FILES["train" if train else "test"])
        images, labels = read_idx_pair(img, lab)
        limits = os.environ.get("HPCASYNC_STANDIN_LIMIT", "")
        if limits:
            n = int(limits.split(",")[0 if train else 1])
            images, labels = images[:n], labels[:n]
        self.data = torch.from_numpy(images.copy())
        self.targets = torch.from_numpy(labels.astype("int64"))
        self.transform, self.target_transform = transform, target_transform
        self.train, self.root = train, root

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int):
        img, target = self.data[i], int(self.targets[i])
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return img, target
