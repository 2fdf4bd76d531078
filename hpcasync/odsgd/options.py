"""The ``hpcasync train`` options of OD-SGD (``--algorithm odsgd``): torch-free, so that a command
line is parsed, and a bad option said, before any rank imports torch."""
from __future__ import annotations


def add_arguments(parser) -> None:
    group = parser.add_argument_group("odsgd")
    group.add_argument("--odsgd-local-opt", default="dc-adaptive",
                       help="local optimizer: sgd, dc or dc-adaptive (default)")
    group.add_argument("--odsgd-local-lr", type=float, default=0.5,
                       help="local lr η_l on g/N, as the authors' (0.5)")
    group.add_argument("--odsgd-delta", default="last-step",
                       help="Δ of the dc modes: last-step (W_t − W_t−1, default) or gap "
                            "(W_t − W^l_t)")
    group.add_argument("--odsgd-warmup-iters", type=int, default=200,
                       help="first N steps are plain SSGD (200)")
    group.add_argument("--odsgd-lambda", type=float, default=None,
                       help="λ (dc, default 0.04) or λ₀ (dc-adaptive, default 2)")
    group.add_argument("--odsgd-ms-momentum", type=float, default=0.0,
                       help="dc-adaptive mean-square momentum m (0: the authors' CADCASGD)")
    group.add_argument("--odsgd-progress", default="thread",
                       help="how the round in flight progresses: thread (default), hooks, none")
