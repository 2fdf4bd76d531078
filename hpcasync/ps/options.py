"""The ``hpcasync train`` options of the parameter server's algorithms: torch-free, so that a
command line is parsed, and a bad option said, before any rank imports torch."""
from __future__ import annotations

from .. import registry
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
    g.add_argument("--ps-momentum", type=float, default=0.0,
                   help="shared server-side momentum of asgd/dcasgd/lcasgd/shat/rennala/ringmaster/asgd-da "
                        "(default 0)")
    g.add_argument("--dc-lambda", type=float, default=None, help="dcasgd: constant λ (0.04)")
    g.add_argument("--dc-lambda0", type=float, default=None, help="dcasgd-a: λ₀ (2.0)")
    g.add_argument("--dc-ms-momentum", type=float, default=None,
                   help="dcasgd-a: mean-square momentum m (0.95)")
    g.add_argument("--lc-predictor", default=None,
                   help="lcasgd: linear (default), ema, lstm, oracle")
    g.add_argument("--lc-lambda", type=float, default=None, help="lcasgd: λ (1.0)")
    g.add_argument("--lc-anchor", default=None, help="lcasgd: push (default) or fit")
    g.add_argument("--lc-window", type=int, default=None, help="lcasgd: history points K (32)")
    g.add_argument("--lc-max-factor", type=float, default=None,
                   help="lcasgd: upper bound of the compensation factor (1.0; inf = unbounded)")
    g.add_argument("--smega2-estimate", default=None, help="smega2: advanced (default) or naive")
    g.add_argument("--rennala-batch", type=int, default=None,
                   help="rennala: fresh gradients per step B (default: the number of workers)")
    g.add_argument("--ringmaster-r", type=int, default=None,
                   help="ringmaster: the delay R from which a gradient is dropped (default: the "
                        "number of workers)")
    g.add_argument("--rennala-stop", action="store_const", const=True, default=None,
                   help="rennala: when θ steps, stop every computation at the old θ and start it "
                        "again at the new one (the paper's broadcast; hpcasync sim only)")
    g.add_argument("--ringmaster-stop", action="store_const", const=True, default=None,
                   help="ringmaster: stop a computation as soon as its delay reaches R and start "
                        "it again at θ (the paper's variant; hpcasync sim only)")
    g.add_argument("--da-tau-c", type=int, default=None,
                   help="asgd-da: the delay τ_C up to which the full lr is used; a gradient at "
                        "delay δ > τ_C steps with lr·τ_C/δ (default: the number of workers)")
    g.add_argument("--ps-warmup-epochs", type=float, default=None,
                   help="linear lr warm-up from lr/N over this many epochs (default: 5 for smega2, "
                        "dana, nag as in the SMEGA2 paper, with its x0.1 steps at epochs 80 and "
                        "120; 0 for the others)")
    add_hetero_arguments(parser)


def validate_options(cfg) -> None:
    """The checks that need no torch (``hpcasync train`` makes them before importing it): an option
    of another algorithm, ``--ps-momentum`` beside a momentum rule, the warm-up's length."""
    opt = cfg.options
    for option, owners in registry.option_owners().items():
        if opt.get(option) is not None and cfg.algorithm not in owners:
            flag = "--" + option.replace("_", "-")
            raise ConfigError(f"{flag} applies to {', '.join(owners)}, not {cfg.algorithm}")
    if opt.get("ps_momentum", 0.0) and registry.get(cfg.algorithm).momentum_rule:
        raise ConfigError(f"--ps-momentum does not apply to {cfg.algorithm}; use --momentum")
    warm = opt.get("ps_warmup_epochs")
    if warm is not None and not 0 <= warm < float("inf"):
        raise ConfigError(f"--ps-warmup-epochs must be a finite number >= 0, got {warm}")
