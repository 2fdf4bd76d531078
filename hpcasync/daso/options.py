"""The ``hpcasync train`` options of DASO (``--algorithm daso``): torch-free, so that a command line
is parsed, and a bad option said, before any rank imports torch."""
from __future__ import annotations

#: DASO (Coquelin et al.) sends global messages in pieces of 10 M elements (the same number as
#: :data:`hpcasync.comm.DASO_CHUNK_ELEMS`, which imports torch; a unit test keeps them equal)
DASO_CHUNK_ELEMS = 10_000_000


def add_arguments(parser) -> None:
    g = parser.add_argument_group("daso")
    g.add_argument("--daso-warmup-epochs", type=int, default=4,
                   help="blocking epochs at the start (default 4)")
    g.add_argument("--daso-cooldown-epochs", type=int, default=4,
                   help="blocking epochs at the end (default 4)")
    g.add_argument("--daso-global-skip", type=int, default=4,
                   help="batches between global sends in the first cycling epoch (default 4)")
    g.add_argument("--daso-local-skip", type=int, default=1,
                   help="batches between node-local gradient averages (default 1)")
    g.add_argument("--daso-batches-to-wait", type=int, default=1,
                   help="batches between a global send and its merge (default 1)")
    g.add_argument("--daso-max-global-skips", type=int, default=8,
                   help="global skip after a reset from (1, 1, 1) (default 8)")
    g.add_argument("--daso-cast", choices=("none", "bf16", "fp16"), default="bf16",
                   help="wire format of every message between nodes (default bf16)")
    g.add_argument("--daso-plateau-patience", type=int, default=3,
                   help="epochs without improvement that make a plateau (default 3)")
    g.add_argument("--daso-plateau-threshold", type=float, default=0.05,
                   help="relative loss improvement that counts (default 0.05)")
    g.add_argument("--daso-chunk-elems", type=int, default=DASO_CHUNK_ELEMS,
                   help=f"largest piece of a global send, in elements (default {DASO_CHUNK_ELEMS})")
    g.add_argument("--daso-link-delay-us-per-mb", type=float, default=0.0,
                   help="emulated slow inter-node link: µs per 10^6 bytes of every global "
                        "message (default 0: off)")
