"""``hpcasync.optim.AlgorithmOptimizer``: an algorithm that owns its update starts without
``torch._dynamo``.

torch's ``Optimizer.__init__`` (through ``add_param_group``) and ``state_dict`` are wrapped in
``torch._disable_dynamo``, whose first call imports ``torch._dynamo``: 2-3.5 CPU-s in every
process, about half of a parameter-server or OD-SGD rank's start-up. The base calls the functions
underneath (``hpcasync/optim.py``); the CLI builds no trial optimizer for those algorithms
(``plugins.check_run`` with ``optimizer=None``). The CLI side:
``tests/mpi/test_cli.py::test_an_own_update_rule_run_never_imports_torch_dynamo``.
"""
import subprocess
import sys
import textwrap

from tests.mpi_util import REPO, clean_env

CODE = textwrap.dedent('''
    import sys, warnings, torch
    warnings.simplefilter("ignore")   # the scheduler steps before any optimizer step
    from torch import nn
    from hpcasync.comm import FlatModel
    from hpcasync.optim import AlgorithmOptimizer

    class Owned(AlgorithmOptimizer):
        algorithm = "owned"

        def __init__(self, model):
            self._own(FlatModel(model), {"lr": 0.1, "momentum": 0.0, "weight_decay": 0.0})

    model = nn.Linear(3, 2)
    opt = Owned(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    model(torch.ones(1, 3)).sum().backward()
    opt.zero_grad()
    sched.step()
    state = opt.state_dict()
    opt.param_groups[0]["lr"] = 1.0
    opt.load_state_dict(state)
    assert [len(g["params"]) for g in opt.param_groups] == [2], opt.param_groups
    assert opt.param_groups[0]["lr"] == 0.05, opt.param_groups[0]["lr"]
    assert state["param_groups"][0]["params"] == [0, 1], state["param_groups"]
    assert "torch._dynamo" not in sys.modules, "the owned optimizer imported torch._dynamo"
    torch.optim.SGD(model.parameters(), lr=0.1)       # the premise: torch's own optimizer does
    assert "torch._dynamo" in sys.modules, "torch.optim.SGD no longer imports torch._dynamo"
    print("ok")
''')


def test_an_owned_algorithm_optimizer_never_imports_torch_dynamo():
    r = subprocess.run([sys.executable, "-c", CODE], cwd=REPO, env=clean_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_grad_scaler_on_a_family_that_does_not_handle_it_is_a_one_line_error():
    """Every family's optimizer takes ``GradScaler.step`` calls itself
    (``_step_supports_amp_scaling``), so the scaler never skips a step on one rank alone; a
    family that does not handle the scaler (all but ssgd) stops there with one line."""
    import pytest
    import torch
    from torch import nn

    from hpcasync.comm import FlatModel
    from hpcasync.errors import ConfigError
    from hpcasync.optim import AlgorithmOptimizer

    class Owned(AlgorithmOptimizer):
        algorithm = "owned"

        def __init__(self, model):
            self._own(FlatModel(model), {"lr": 0.1})

        def step(self, closure=None):
            self.flat.params.sub_(0.1 * self.flat.grads)

    model = nn.Linear(3, 2)
    opt, scaler = Owned(model), torch.amp.GradScaler("cpu")
    before = opt.flat.params.clone()
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    with pytest.raises(ConfigError, match="owned: torch.amp.GradScaler is not supported") as err:
        scaler.step(opt)
    assert "\n" not in str(err.value) and torch.equal(opt.flat.params, before)
    opt.step()                                  # without the scaler: steps as before
    assert not torch.equal(opt.flat.params, before)
