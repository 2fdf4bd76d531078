"""The ``hpcasync train`` options of SSGD (``--algorithm ssgd``): torch-free, so that a command line
is parsed, and a bad option said, before any rank imports torch."""
from __future__ import annotations

import argparse

from ..runtime import join

#: how overlapped buckets progress (:class:`hpcasync.ssgd.buckets.BucketReducer`): a
#: communication thread of blocking allreduces, or nonblocking ones tested from the gradient hooks
PROGRESS = ("thread", "test")
#: the default ``progress``; to be settled by ``hpcasync bench ssgd`` on an idle machine (columns
#: ``ours`` and ``ours-test``)
DEFAULT_PROGRESS = "thread"


def add_arguments(parser) -> None:
    group = parser.add_argument_group("ssgd")
    group.add_argument("--compress", choices=("none", "bf16", "fp16"), default="none",
                       help="wire format of gradient allreduces (ssgd, daso)")
    group.add_argument("--link-delay-us-per-mb", type=float, default=0.0,
                       help="ssgd: emulated slow inter-node link, µs per 10^6 bytes of each "
                            "step's gradient message (only with more than one node; default 0)")
    group.add_argument("--ssgd-overlap", action=argparse.BooleanOptionalAction, default=None,
                       help="ssgd: start each gradient bucket's allreduce during backward "
                            "(default: on with --device cuda, off on the CPU, where the "
                            "communication thread measured slower; --no-ssgd-overlap reduces the "
                            "same buckets after backward)")
    group.add_argument("--ssgd-bucket-mb", type=float, default=None,
                       help="ssgd: gradient bucket size in MiB (default: 0.25 with overlap, one "
                            "bucket of up to 64 without)")
    group.add_argument("--ssgd-progress", choices=PROGRESS, default=DEFAULT_PROGRESS,
                       help="ssgd: how overlapped buckets progress: a communication thread of "
                            "blocking allreduces, or nonblocking ones tested from the gradient "
                            "hooks (default %(default)s)")
    join.add_arguments(group)
