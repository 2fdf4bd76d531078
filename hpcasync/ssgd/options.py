"""The ``hpcasync train`` options of the ``ssgd`` family: SSGD's own (``--compress``, the buckets,
the emulated link) and each method's registry :class:`~hpcasync.registry.Option` s (``--localsgd-*``,
``--slowmo-*``, ``--diloco-*``). Torch-free, so that a command line is parsed, and a bad option
said, before any rank imports torch."""
from __future__ import annotations

import argparse

from .. import registry
from ..errors import ConfigError
from ..runtime import join

#: options of this family without its name in front (``runtime.family_options``: refused for
#: another family's algorithm, which would ignore them; DASO has ``--daso-link-delay-us-per-mb``)
FAMILY_OPTIONS = ("link_delay_us_per_mb",)
#: how overlapped buckets progress (:class:`hpcasync.ssgd.buckets.BucketReducer`): a
#: communication thread of blocking allreduces, or nonblocking ones tested from the gradient hooks
PROGRESS = ("thread", "test")
#: the default ``progress``; to be settled by ``hpcasync bench ssgd`` on an idle machine (columns
#: ``ours`` and ``ours-test``)
DEFAULT_PROGRESS = "thread"


def add_arguments(parser) -> None:
    group = parser.add_argument_group("ssgd")
    group.add_argument("--compress", choices=("none", "bf16", "fp16", "powersgd"), default="none",
                       help="ssgd: the gradient allreduce's wire format (bf16, fp16), or PowerSGD's "
                            "rank-r compression with error feedback (as DDP's powerSGD_hook)")
    group.add_argument("--powersgd-rank", type=int, default=1,
                       help="with --compress powersgd: the rank r of each approximation "
                            "(default %(default)s)")
    group.add_argument("--powersgd-start-iter", type=int, default=1000,
                       help="with --compress powersgd: plain averaging for this many steps first "
                            "(default %(default)s, torch's)")
    group.add_argument("--powersgd-min-compression-rate", type=float, default=2.0,
                       help="with --compress powersgd: compress a matrix only when it shrinks at "
                            "least this many times (default %(default)s)")
    group.add_argument("--powersgd-error-feedback", action=argparse.BooleanOptionalAction,
                       default=True, help="with --compress powersgd: error feedback (default on)")
    group.add_argument("--powersgd-warm-start", action=argparse.BooleanOptionalAction,
                       default=True, help="with --compress powersgd: start each power iteration "
                            "from the last Q (default on)")
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
    registry.add_options(group, "ssgd")      # localsgd, slowmo, diloco and any added method
    join.add_arguments(group)


#: the ``--powersgd-*`` options and their defaults
POWERSGD_OPTIONS = {"powersgd_rank": 1, "powersgd_start_iter": 1000,
                    "powersgd_min_compression_rate": 2.0, "powersgd_error_feedback": True,
                    "powersgd_warm_start": True}


def check_compress(cfg) -> None:
    """``--compress`` is SSGD's (another family would ignore it), ``--powersgd-*`` need
    ``--compress powersgd``: one-line errors, whatever the algorithm (torch-free)."""
    o = cfg.options
    compress = o.get("compress", "none")
    if compress != "none" and cfg.algorithm != "ssgd":
        raise ConfigError(f"--compress applies to ssgd, not {cfg.algorithm}")
    if compress != "powersgd":
        given = [k for k, v in POWERSGD_OPTIONS.items() if o.get(k, v) != v]
        if given:
            raise ConfigError(f"--{given[0].replace('_', '-')} applies with --compress powersgd")
