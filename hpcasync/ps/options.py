"""The ``hpcasync train`` options of the parameter server's algorithms: torch-free, so that a
command line is parsed, and a bad option said, before any rank imports torch."""
from __future__ import annotations

from .. import registry
from ..config import TrainConfig
from ..errors import ConfigError
from ..hetero import add_arguments as add_hetero_arguments


def add_arguments(parser) -> None:
    g = parser.add_argument_group(f"parameter server ({', '.join(registry.ps_names())})")
    g.add_argument("--ps-transport", default="rma", choices=("rma", "rma-put", "p2p"),
                   help="rma: one-sided Put in / Get out (default); rma-put: the PS Puts replies; "
                        "p2p: two-sided Isend/Recv")
    g.add_argument("--ps-ranks", type=int, default=1,
                   help="K server ranks (--ps-rank and the K-1 after it), each serving a "
                        "contiguous shard of the parameters; the other ranks train (default 1)")
    plain = [n for n in registry.ps_names() if n not in registry.momentum_rules()]
    g.add_argument("--ps-momentum", type=float, default=0.0,
                   help=f"shared server-side momentum of {'/'.join(plain)} (default 0)")
    registry.add_options(g, "ps")                # each rule's own (its registry entry's)
    g.add_argument("--ps-warmup-epochs", type=float, default=None,
                   help="linear lr warm-up from lr/N over this many epochs (default: 5 for smega2, "
                        "dana, nag as in the SMEGA2 paper, with its x0.1 steps at epochs 80 and "
                        "120; 0 for the others)")
    add_hetero_arguments(parser)


def validate_options(cfg) -> None:
    """The checks that need no torch (``hpcasync train`` makes them before importing it, after
    the refusal of another algorithm's option: ``runtime.argument_checks``): ``--ps-momentum``
    beside a momentum rule, ``--momentum`` beside another rule (where it would do nothing), the
    warm-up's length."""
    opt = cfg.options
    momentum_rule = registry.get(cfg.algorithm).momentum_rule
    if opt.get("ps_momentum", 0.0) and momentum_rule:
        raise ConfigError(f"--ps-momentum does not apply to {cfg.algorithm}; use --momentum")
    if not momentum_rule and cfg.momentum != TrainConfig.momentum:
        raise ConfigError(f"--momentum does not apply to {cfg.algorithm} (its workers push "
                          f"gradients); its server's momentum is --ps-momentum")
    warm = opt.get("ps_warmup_epochs")
    if warm is not None and not 0 <= warm < float("inf"):
        raise ConfigError(f"--ps-warmup-epochs must be a finite number >= 0, got {warm}")
