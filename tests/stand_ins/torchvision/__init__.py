"""A test-only stand-in for the three corners of ``torchvision`` that Horovod's PyTorch examples
use: ``datasets.MNIST``, ``transforms`` (Compose, ToTensor, Normalize) and ``models.resnet*``.

Why: PyPI's torchvision wheels link the CUDA build of torch and do not import beside the CPU wheel
this project installs (torch 2.13.0+cpu), and Horovod's examples import torchvision at the top.
``tests/mpi/test_horovod_examples.py`` puts this directory first on ``PYTHONPATH`` so that
``from torchvision import datasets, transforms, models`` resolves here; nothing outside the tests
uses it. It is written from the documented behaviour of those APIs, not from torchvision's code.

Differences from torchvision (what the examples could notice):

* ``datasets.MNIST`` serves **Fashion-MNIST** (the same IDX format: 28x28 grey images, 10 classes)
  from Debian's ``dataset-fashion-mnist`` through :mod:`hpcasync.data` (or the built-in real
  subset), because MNIST digits are not packaged and nothing may be downloaded; ``download`` and
  ``root`` are accepted and ignored. ``HPCASYNC_STANDIN_LIMIT=TRAIN,TEST`` keeps the first
  examples of each split (the tests' time budget).
* images are ``uint8`` tensors (not PIL images); ``transforms.ToTensor`` takes those, numpy
  arrays and PIL-like objects with ``__array__``.
* ``models`` has the ResNets of He et al. (2016) (18/34/50/101/152, ``num_classes`` keyword) and
  nothing else; no pretrained weights.
"""
from . import datasets, models, transforms  # noqa: F401

__version__ = "0.0-hpcasync-test-stand-in"
