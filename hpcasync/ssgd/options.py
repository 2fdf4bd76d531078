"""The ``hpcasync train`` options of SSGD (``--algorithm ssgd``): torch-free, so that a command line
is parsed, and a bad option said, before any rank imports torch."""
from __future__ import annotations

import argparse

from ..errors import ConfigError
from ..runtime import join

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
    group.add_argument("--localsgd-period", type=int, default=None,
                       help="localsgd: steps between two averages of the parameters (default 4, "
                            "torch's example)")
    group.add_argument("--localsgd-warmup-steps", type=int, default=None,
                       help="localsgd: SSGD steps before the local ones (post-local SGD; default "
                            "100, torch's example)")
    group.add_argument("--slowmo-period", type=int, default=None,
                       help="slowmo: local steps between two syncs (default 48, fairscale's)")
    group.add_argument("--slowmo-momentum", type=float, default=None,
                       help="slowmo: the slow momentum beta (default 0.5)")
    group.add_argument("--slowmo-lr", type=float, default=None,
                       help="slowmo: the slow lr alpha (default 1.0)")
    group.add_argument("--diloco-sync-every", type=int, default=None,
                       help="diloco: inner steps between two syncs of each fragment (H; default "
                            "500, the paper's)")
    group.add_argument("--diloco-outer-lr", type=float, default=None,
                       help="diloco: the outer SGD's lr (default 0.7, the paper's)")
    group.add_argument("--diloco-outer-momentum", type=float, default=None,
                       help="diloco: the outer SGD's Nesterov momentum (default 0.9)")
    group.add_argument("--diloco-fragments", type=int, default=None,
                       help="diloco: Streaming DiLoCo's fragments, runs of the model's top-level "
                            "modules (default 1)")
    group.add_argument("--diloco-sync-delay", type=int, default=None,
                       help="diloco: inner steps between a fragment's pseudo-gradient and its "
                            "outer step (Streaming DiLoCo's tau; default 0)")
    group.add_argument("--diloco-alpha", type=float, default=None,
                       help="diloco: share of the rank's own parameters mixed into the outer "
                            "result (Streaming DiLoCo's alpha; default 0)")
    group.add_argument("--diloco-hierarchical", action="store_const", const=True, default=None,
                       help="diloco: the ranks of a node train one replica with synchronous SGD, "
                            "DiLoCo runs across the nodes (--ranks-per-node sets virtual nodes; "
                            "nodes of equal size; not under --with-ft ulfm)")
    group.add_argument("--diloco-quantize", action="store_const", const=True, default=None,
                       help="diloco: exchange the outer gradients as FP8 (E4M3, a scale per "
                            "chunk) and average them in float32, as torchft's should_quantize "
                            "(not with --diloco-hierarchical)")
    join.add_arguments(group)


#: the ``--powersgd-*`` options and their defaults
POWERSGD_OPTIONS = {"powersgd_rank": 1, "powersgd_start_iter": 1000,
                    "powersgd_min_compression_rate": 2.0, "powersgd_error_feedback": True,
                    "powersgd_warm_start": True}


def validate_options(cfg) -> None:
    """The family's torch-free checks: the ``--localsgd-*`` options are localsgd's, the
    ``--diloco-*`` ones diloco's."""
    for owner, names in (("localsgd", ("localsgd_period", "localsgd_warmup_steps")),
                         ("slowmo", ("slowmo_period", "slowmo_momentum", "slowmo_lr")),
                         ("diloco", ("diloco_sync_every", "diloco_outer_lr",
                                     "diloco_outer_momentum", "diloco_fragments",
                                     "diloco_sync_delay", "diloco_alpha",
                                     "diloco_hierarchical", "diloco_quantize"))):
        if cfg.algorithm == owner:
            continue
        for name in names:
            if cfg.options.get(name) is not None:
                raise ConfigError(f"--{name.replace('_', '-')} applies to {owner}, not "
                                  f"{cfg.algorithm}")


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
