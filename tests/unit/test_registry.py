"""One algorithm registry (issue 25): the names with their families live in
``hpcasync.registry`` alone; every other list of names derives from it when used, so a fake 15th
algorithm registered here shows in the front door, the CLI, the rules, the parameter server and the
simulator, and trains exactly as the rule it copies. Duplicate and unknown names are one-line
ConfigErrors; the registry is a low layer (stdlib and ``hpcasync.errors``; no torch)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hpcasync
from hpcasync import api, config, registry, rules
from hpcasync.errors import ConfigError
from hpcasync.options import command_parser
from hpcasync.ps import optimizer as ps_optimizer
from hpcasync.ps import runtime as ps_runtime
from hpcasync.ssgd import runtime as ssgd_runtime
from hpcasync.runtime import RUNTIMES, argument_checks, runtime_module, runtime_modules
from hpcasync.runtime import algorithms as runtime_algorithms
from hpcasync.sim import driver as sim_driver

PS = ("asgd", "dcasgd", "dcasgd-a", "lcasgd", "shat", "shat-root", "ensemble", "asp", "smega2",
      "dana", "nag", "rennala", "ringmaster", "asgd-da")
SMALL = ["--dataset", "fashion-mnist-mini", "--train-limit", "256", "--test-limit", "64",
         "--epochs", "1", "--progress", "off", "--batch-size", "16", "--model", "mlp"]


@pytest.fixture
def copy_alg():
    """A fake 15th algorithm: ASGD under another name, with its own default lr."""
    alg = registry.register(registry.ps_algorithm("asgd-copy", "hpcasync.rules.asgd:ASGD",
                                                  "ASGD again", default_lr=0.03))
    try:
        yield alg
    finally:
        registry.unregister("asgd-copy")


def _derived() -> dict[str, tuple]:
    """Every list of names hpcasync exposes outside the registry."""
    return {
        "api.algorithms": api.algorithms(), "hpcasync.algorithms": hpcasync.algorithms(),
        "runtime.algorithms": runtime_algorithms(), "RUNTIMES": tuple(RUNTIMES),
        "api.PS_ALGORITHMS": tuple(api.PS_ALGORITHMS), "rules.RULES": tuple(rules.RULES),
        "ps.runtime.ALGORITHMS": tuple(ps_runtime.ALGORITHMS),
        "ps.optimizer.ALGORITHMS": tuple(ps_optimizer.ALGORITHMS),
        "api.SYNC_ALGORITHMS": tuple(api.SYNC_ALGORITHMS),
        "rules.MOMENTUM_RULES": tuple(rules.MOMENTUM_RULES),
        "config.OPTIMIZER_ALGORITHMS": tuple(config.OPTIMIZER_ALGORITHMS),
        "config.ALGORITHM_LR": tuple(config.ALGORITHM_LR.items()),
    }


def _expected() -> dict[str, tuple]:
    every, ps = registry.names(), registry.ps_names()
    return {"api.algorithms": every, "hpcasync.algorithms": every, "runtime.algorithms": every,
            "RUNTIMES": every, "api.PS_ALGORITHMS": ps, "rules.RULES": ps,
            "ps.runtime.ALGORITHMS": ps, "ps.optimizer.ALGORITHMS": ps,
            "api.SYNC_ALGORITHMS": registry.sync_names(),
            "rules.MOMENTUM_RULES": registry.momentum_rules(),
            "config.OPTIMIZER_ALGORITHMS": registry.user_optimizer_names(),
            "config.ALGORITHM_LR": tuple(registry.algorithm_lrs().items())}


def test_the_sixteen_and_their_families():
    assert registry.names() == ("ssgd", "daso", "odsgd", "localsgd", "slowmo", "diloco", *PS)
    assert {n: registry.get(n).family for n in ("ssgd", "daso", "odsgd")} == {
        "ssgd": "ssgd", "daso": "daso", "odsgd": "odsgd"}
    assert registry.ps_names() == PS == registry.by_family("ps")
    assert registry.sync_names() == ("ssgd", "daso", "odsgd", "localsgd", "slowmo", "diloco")
    assert registry.momentum_rules() == ("smega2", "dana", "nag")
    assert registry.user_optimizer_names() == ("ssgd", "daso", "localsgd", "slowmo", "diloco")
    assert registry.horovod_names() == ("ssgd", "daso")
    assert registry.simulated_names() == ("ssgd", *PS)
    assert registry.algorithm_lrs() == {"nag": 0.02} and config.default_lr("asgd") == 0.05
    assert {n: RUNTIMES[n] for n in ("ssgd", "daso", "odsgd", "nag")} == {
        "ssgd": "hpcasync.ssgd.runtime", "daso": "hpcasync.daso.runtime",
        "odsgd": "hpcasync.odsgd.runtime", "nag": "hpcasync.ps.runtime"}
    assert registry.option_owners() == {
        "localsgd_period": ("localsgd",), "localsgd_warmup_steps": ("localsgd",),
        **{f"slowmo_{k}": ("slowmo",) for k in ("period", "momentum", "lr")},
        **{f"diloco_{k}": ("diloco",) for k in ("sync_every", "outer_lr", "outer_momentum",
                                                 "fragments", "sync_delay", "alpha",
                                                 "hierarchical", "quantize")},
        "dc_lambda": ("dcasgd",), "dc_lambda0": ("dcasgd-a",), "dc_ms_momentum": ("dcasgd-a",),
        "lc_predictor": ("lcasgd",), "lc_lambda": ("lcasgd",), "lc_anchor": ("lcasgd",),
        "lc_window": ("lcasgd",), "lc_max_factor": ("lcasgd",), "smega2_estimate": ("smega2",),
        "rennala_batch": ("rennala",), "rennala_stop": ("rennala",), "ringmaster_r": ("ringmaster",),
        "ringmaster_stop": ("ringmaster",), "da_tau_c": ("asgd-da",)}
    for name in PS:                                # each rule is the class its entry names
        module, cls = registry.get(name).rule.split(":")
        assert rules.RULES[name].func.__name__ == cls and module.startswith("hpcasync.rules.")
    assert {n: rules.RULES[n].keywords for n in PS if rules.RULES[n].keywords} == {
        "dcasgd": {"mode": "constant"}, "dcasgd-a": {"mode": "adaptive"},
        "shat": {"alpha_mode": "log"}, "shat-root": {"alpha_mode": "root"},
        "ensemble": {"alpha_mode": "ensemble"}, "asp": {"alpha_mode": "asp"}}


def test_every_derived_list_is_the_registry():
    assert _derived() == _expected()
    assert len(api.algorithms()) == 20


def test_a_registered_twenty_first_shows_everywhere(copy_alg):
    assert registry.names()[-1] == "asgd-copy" and len(api.algorithms()) == 21
    assert _derived() == _expected()
    for name, names in _derived().items():
        if name not in ("api.SYNC_ALGORITHMS", "rules.MOMENTUM_RULES",
                        "config.OPTIMIZER_ALGORITHMS"):
            assert "asgd-copy" in names or ("asgd-copy", 0.03) in names, name
    assert "asgd-copy" in api.PS_ALGORITHMS and "asgd-copy" in ps_optimizer.ALGORITHMS
    assert runtime_module("asgd-copy") is ps_runtime
    assert ps_runtime in runtime_modules()
    assert "asgd-copy" in registry.simulated_names()
    assert config.TrainConfig(algorithm="asgd-copy").lr == 0.03
    # the rule: an ASGD, and the same θ as asgd's on the same pushes
    theta0 = torch.arange(6, dtype=torch.float32)
    a = rules.make_rule("asgd", theta0, 2, lr=0.1, momentum=0.5)
    b = rules.make_rule("asgd-copy", theta0, 2, lr=0.1, momentum=0.5)
    assert type(b) is rules.ASGD
    assert rules.rule_hyperparameters("asgd-copy") == rules.rule_hyperparameters("asgd")
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        grad = torch.randn(6, generator=g)
        ra = a.on_push(step % 2, grad, rules.PushMeta(version=max(step - 1, 0)))
        rb = b.on_push(step % 2, grad, rules.PushMeta(version=max(step - 1, 0)))
        assert torch.equal(ra.params, rb.params) and ra.version == rb.version
    assert torch.equal(a.theta, b.theta) and not torch.equal(a.theta, theta0)


def test_the_front_door_and_the_cli_take_a_new_one(copy_alg):
    model = torch.nn.Linear(3, 2)
    for call in (lambda: hpcasync.optimizer("asgd-copy", model),
                 lambda: hpcasync.optimizer("asgd-copy", model, lr=0.1, lam=1.0)):
        with pytest.raises(ConfigError) as err:          # past the name check, to the rule's
            call()
        assert "unknown algorithm" not in str(err.value)
    with pytest.raises(ConfigError, match="unknown algorithm 'asgd-copy2'"):
        hpcasync.optimizer("asgd-copy2", model, lr=0.1)
    args = command_parser("train").parse_args(["--algorithm", "asgd-copy", *SMALL])
    cfg = config.config_from_args(args)
    assert cfg.lr == 0.03
    cfg.validate(runtime_algorithms())
    ps_runtime.validate(cfg)
    assert ps_runtime.rule_hyper(cfg) == {"lr": 0.03, "weight_decay": 0.0, "momentum": 0.0}
    args = command_parser("train").parse_args(["--algorithm", "asgd-copy", "--dc-lambda", "0.1",
                                               *SMALL])
    with pytest.raises(ConfigError, match="--dc-lambda applies to dcasgd, not asgd-copy"):
        argument_checks(config.config_from_args(args))
    args = command_parser("train").parse_args(["--algorithm", "dcasgd-a", "--dc-lambda0", "2.5",
                                               "--dc-ms-momentum", "0.9", *SMALL])
    hyper = ps_runtime.rule_hyper(config.config_from_args(args))     # the entry's options
    assert (hyper["lam"], hyper["ms_momentum"]) == (2.5, 0.9)


def _sim(algorithm: str) -> dict:
    args = command_parser("sim").parse_args(["--algorithm", algorithm, "--workers", "2",
                                             "--lr", "0.05", *SMALL])
    return sim_driver.simulate(config.config_from_args(args))


@pytest.mark.timeout(120)
def test_the_simulator_trains_a_new_one_as_the_rule_it_copies(copy_alg):
    skip = ("time_s", "wall_time_s", "algorithm")
    copy, asgd = _sim("asgd-copy"), _sim("asgd")
    assert copy["algorithm"] == "asgd-copy" and copy["test_accuracy"] > 0.2
    assert {k: v for k, v in copy.items() if k not in skip} == {
        k: v for k, v in asgd.items() if k not in skip}


def test_init_arguments_ignored_or_failing_late_are_one_line():
    """``hpcasync.init("ssgd", ps_rank=1)`` (or ``ps_ranks=2``) placed no server and said nothing;
    ``threads=0`` was torch's RuntimeError once MPI was up: one line each, before MPI starts."""
    import hpcasync

    for kw in ({"ps_rank": 1}, {"ps_ranks": 2}):
        with pytest.raises(ConfigError, match="ps_rank= and ps_ranks= place a parameter server; "
                                              "ssgd has none"):
            hpcasync.init("ssgd", **kw)
    for bad in (0, -2, 1.5):        # (torch's RuntimeError after MPI was up, a traceback)
        with pytest.raises(ConfigError, match=rf"threads must be an integer >= 1 .*got {bad}"):
            hpcasync.init("ssgd", threads=bad)


def test_duplicates_and_unknown_names_are_one_line_errors():
    with pytest.raises(ConfigError, match="'asgd' is already registered") as err:
        registry.register(registry.ps_algorithm("asgd", "hpcasync.rules.asgd:ASGD"))
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError) as err:
        registry.get("sgd")
    assert str(err.value) == f"unknown algorithm 'sgd' (choose from {', '.join(registry.names())})"
    with pytest.raises(ConfigError, match="unknown algorithm 'nope'"):
        runtime_module("nope")
    with pytest.raises(ConfigError, match="unknown rule 'ssgd'"):
        rules.make_rule("ssgd", torch.zeros(1), 1, lr=0.1)
    with pytest.raises(ConfigError, match="unknown algorithm 'nope'"):
        registry.unregister("nope")
    with pytest.raises(ConfigError, match="family 'pss' is not one of"):
        registry.register(registry.Algorithm("x", "pss", "hpcasync.ps.runtime"))
    with pytest.raises(ConfigError, match="the ps family, and only it, has an update rule"):
        registry.register(registry.Algorithm("x", "ps", "hpcasync.ps.runtime"))
    with pytest.raises(ConfigError, match="is not 'module:Class'"):
        registry.register(registry.ps_algorithm("x", "hpcasync.rules.asgd.ASGD"))
    with pytest.raises(ConfigError, match="the ssgd family, and only it, names its optimizer"):
        registry.register(registry.Algorithm("x", "ssgd", "hpcasync.ssgd.runtime"))
    with pytest.raises(ConfigError, match="the ssgd family, and only it, names its optimizer"):
        registry.register(registry.Algorithm("x", "daso", "hpcasync.daso.runtime",
                                             optimizer="hpcasync.ssgd.localsgd:LocalSGD"))
    with pytest.raises(ConfigError, match="optimizer 'hpcasync.ssgd.LocalSGD' is not"):
        registry.register(registry.sync_method("x", "hpcasync.ssgd.LocalSGD"))
    with pytest.raises(ConfigError, match="needs a non-empty name"):
        registry.register(registry.ps_algorithm("", "hpcasync.rules.asgd:ASGD"))
    # nothing half-registered
    assert registry.names() == ("ssgd", "daso", "odsgd", "localsgd", "slowmo", "diloco", *PS)
    with pytest.raises(ConfigError, match="--algorithm 'x' is not one of: ssgd, "):
        config.TrainConfig(algorithm="x").validate(runtime_algorithms())


def test_the_registry_is_a_low_layer():
    """stdlib and hpcasync.errors only (the families import it, never the reverse), no torch."""
    tree = ast.parse(Path(registry.__file__).read_text())
    ours = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(
                "hpcasync")):
            ours.add(("." * node.level) + (node.module or ""))
        elif isinstance(node, ast.Import):
            ours |= {a.name for a in node.names if a.name.startswith(("hpcasync", "torch"))}
    assert ours == {".errors"}
    r = subprocess.run([sys.executable, "-c", "import sys, hpcasync.registry as r, hpcasync.config;"
                        "assert len(r.names()) == 20; print('torch' in sys.modules)"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


@pytest.mark.parametrize("argv,said", [
    (["train", "--algorithm", "sgdx"], "--algorithm 'sgdx' is not one of"),
    (["train", "--epochs", "0"], "--epochs must be a positive integer"),
    (["train", "--divergence-factor", "0.5"], "--divergence-factor must be 0 (off)"),
    (["train", "--algorithm", "asgd", "--dc-lambda", "0.1"], "--dc-lambda applies to dcasgd"),
    (["train", "--daso-cast", "fp8"], "invalid choice: 'fp8'"),
    (["train", "--help"], "--daso-global-skip"),
    (["train", "--algorithm", "daso", "--compress", "powersgd"], "--compress applies to ssgd, "
                                                                  "not daso"),
    (["train", "--powersgd-rank", "4"], "--powersgd-rank applies with --compress powersgd"),
], ids=["parse", "config", "divergence", "ps-option", "daso-choice", "help", "compress-owner",
        "powersgd-without"])
def test_an_option_error_is_said_before_torch_is_imported(argv, said):
    """Every rank parses the command line: the families' options (``Algorithm.arguments``) and
    the checks that need no torch come first, so a bad option costs each rank ~0.1 s, not torch's
    ~3 s of import (measured: a 4-rank bad-option job 7.2 s -> 1.5 s on the 2-core box)."""
    code = ("import sys\nfrom hpcasync.cli import main\ntry:\n    main(sys.argv[1:])\n"
            "except SystemExit:\n    pass\nprint('torch imported:', 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                       timeout=60)
    assert said in r.stdout + r.stderr, r.stdout + r.stderr
    assert r.stdout.strip().endswith("torch imported: False"), r.stdout + r.stderr


def test_the_torch_free_options_keep_the_runtimes_numbers():
    from hpcasync.comm import DASO_CHUNK_ELEMS
    from hpcasync.daso import options as daso_options
    from hpcasync.ssgd import buckets, options as ssgd_options

    assert daso_options.DASO_CHUNK_ELEMS == DASO_CHUNK_ELEMS
    assert (buckets.PROGRESS, buckets.DEFAULT_PROGRESS) == (ssgd_options.PROGRESS,
                                                           ssgd_options.DEFAULT_PROGRESS)
    for name in registry.names():         # every built-in family names a torch-free module
        assert registry.get(name).arguments == f"hpcasync.{registry.get(name).family}.options"


def test_an_entrys_options_are_added_to_the_parser_and_declared_once():
    """A rule's CLI options come from its registry entry (``registry.Option``): the type, a flag
    for bool, the owners in the help; a second entry declaring the same option with another type
    is refused at registration."""
    import argparse

    registry.register(registry.ps_algorithm("toy-x", "hpcasync.rules.asgd:ASGD", options=(
        registry.Option("toy_n", "n", int, "a count"),
        registry.Option("toy_flag", "flag", bool, "a switch"))))
    try:
        parser = argparse.ArgumentParser()
        registry.add_options(parser.add_argument_group("ps"), "ps")
        ns = parser.parse_args(["--toy-n", "3", "--toy-flag", "--dc-lambda", "0.5"])
        assert (ns.toy_n, ns.toy_flag, ns.dc_lambda) == (3, True, 0.5)
        assert parser.parse_args([]).toy_flag is None
        helps = {a.dest: a.help for a in parser._actions}
        assert helps["toy_n"] == "toy-x: a count"
        with pytest.raises(ConfigError, match="--toy-n is already declared with type int"):
            registry.register(registry.ps_algorithm("toy-y", "hpcasync.rules.asgd:ASGD",
                                                    options=(registry.Option("toy_n", "n"),)))
        assert "toy-y" not in registry.names()
    finally:
        registry.unregister("toy-x")


def _train_cfg(*argv):
    return config.config_from_args(command_parser("train").parse_args([*argv, *SMALL]))


@pytest.mark.parametrize("argv, line", [
    (("--algorithm", "ssgd", "--daso-global-skip", "2"), "--daso-global-skip applies to daso, "
                                                         "not ssgd"),
    (("--algorithm", "localsgd", "--odsgd-delta", "2"), "--odsgd-delta applies to odsgd, not "
                                                        "localsgd"),
    (("--algorithm", "daso", "--ps-transport", "p2p"), "--ps-transport applies to the ps "
                                                       "family's algorithms, not daso"),
    (("--algorithm", "asgd", "--ssgd-progress", "test"), "--ssgd-progress applies to ssgd, "
                                                         "localsgd, slowmo, diloco, not asgd"),
    (("--algorithm", "daso", "--link-delay-us-per-mb", "5"), "--link-delay-us-per-mb applies "
                                                             "to ssgd, localsgd, slowmo, diloco, "
                                                             "not daso"),
    (("--algorithm", "odsgd", "--slowmo-lr", "2"), "--slowmo-lr applies to slowmo, not odsgd"),
    (("--algorithm", "diloco", "--localsgd-period", "2"), "--localsgd-period applies to "
                                                          "localsgd, not diloco"),
    (("--algorithm", "shat", "--momentum", "0.5"), "--momentum does not apply to shat (its "
                                                   "workers push gradients); its server's "
                                                   "momentum is --ps-momentum"),
    (("--algorithm", "diloco", "--ps-rank", "1"), "--ps-rank applies to the ps family's "
                                                  "algorithms, not diloco (it has no server)"),
])
def test_an_option_of_another_family_is_refused_not_ignored(argv, line):
    """Each family's options (named after it, or listed as its ``FAMILY_OPTIONS``) and each
    method's registry options given to another algorithm, ``--momentum`` given to a rule
    without one: one line before MPI (they were ignored: ``--algorithm ssgd --daso-global-skip
    2`` ran plain SSGD). Their defaults pass."""
    with pytest.raises(ConfigError) as err:
        argument_checks(_train_cfg(*argv))
    assert str(err.value) == line
    argument_checks(_train_cfg(*argv[:2]))
    argument_checks(_train_cfg(*argv[:2], "--ps-transport", "rma", "--daso-cast", "bf16"))


def test_a_synchronous_method_is_one_entry_with_its_options():
    """An ``ssgd``-family entry (``registry.sync_method``) names its optimizer class; its
    ``Option`` s are added to the parser, refused for the others, and reach the class's
    constructor through ``cli_keywords`` (LocalSGD's checks included)."""
    import argparse

    from hpcasync.ssgd import optimizer_class
    from hpcasync.ssgd.localsgd import LocalSGD

    registry.register(registry.sync_method(
        "toy-local", "hpcasync.ssgd.localsgd:LocalSGD", "a test's",
        options=(registry.Option("toy_h", "period", int, "H"),)))
    try:
        assert optimizer_class("toy-local") is LocalSGD and optimizer_class("ssgd").__name__ == \
            "DistributedOptimizer"
        parser = argparse.ArgumentParser()
        registry.add_options(parser.add_argument_group("ssgd"), "ssgd")
        assert parser.parse_args(["--toy-h", "3"]).toy_h == 3
        cfg = _train_cfg("--algorithm", "toy-local", "--toy-h", "3")
        argument_checks(cfg)
        assert registry.given("toy-local", cfg.options) == {"period": 3}
        assert LocalSGD.cli_keywords({"period": 3}) == {"period": 3}
        with pytest.raises(ConfigError, match="--toy-h applies to toy-local, not localsgd"):
            argument_checks(_train_cfg("--algorithm", "localsgd", "--toy-h", "3"))
        with pytest.raises(ConfigError, match="localsgd period must be an integer >= 1, got 0"):
            ssgd_runtime.validate(_train_cfg("--algorithm", "toy-local", "--toy-h", "0"))
        for flag in (["--ssgd-progress", "test"], ["--ssgd-bucket-mb", "1"]):   # SSGD's buckets
            with pytest.raises(ConfigError, match=f"{flag[0]} applies to ssgd, not toy-local"):
                ssgd_runtime.validate(_train_cfg("--algorithm", "toy-local", *flag))
    finally:
        registry.unregister("toy-local")
