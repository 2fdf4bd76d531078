"""tests/site/sitecustomize.py: the test run's ``torch._dynamo`` answers torch's two eager no-ops
without the import, its ``torch._meta_registrations`` and ``torch.export`` are not imported, none
changes a result, and each becomes the real module for anything else."""
import os
import subprocess
import sys
from pathlib import Path

SITE = Path(__file__).resolve().parents[1] / "site"

STEPS = """
import sys, torch
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
for opt in (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True),
            torch.optim.Adam(m.parameters(), lr=0.01)):
    for _ in range(3):
        opt.zero_grad()
        m(torch.randn(8, 5)).square().mean().backward()
        opt.step()
    opt.load_state_dict(opt.state_dict())
g = torch.Generator().manual_seed(3)                # (its metaclass: torch._prims.rng_prims's)
draw = torch.randn(4, generator=g)
print(type(sys.modules["torch._dynamo"]).__name__, "torch._decomp" in sys.modules,
      type(sys.modules["torch._meta_registrations"]).__name__,
      type(sys.modules["torch.export"]).__name__, "torch._export" in sys.modules,
      isinstance(g, torch.Generator), type(type(g)).__name__)
print(torch.cat([draw, *(p.detach().reshape(-1) for p in m.parameters())]).numpy().tobytes().hex())
"""


def run(code: str, real: bool) -> list[str]:
    path = [str(SITE), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path),
               HPCASYNC_TEST_REAL_TORCH="1" if real else "0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def test_torch_optimizers_step_bitwise_as_with_the_real_module_without_importing_it():
    *stand_in, params = run(STEPS, real=False)
    *real, params_real = run(STEPS, real=True)
    assert stand_in == ["_Deferred", "False", "_Deferred", "_Deferred", "False", "True",
                        "OpaqueBaseMeta"], "a real torch._dynamo, meta or export import"
    assert real == ["module", "True", "module", "module", "True", "True", "OpaqueBaseMeta"]
    assert params == params_real


def test_any_other_name_gives_the_real_module():
    code = """
import sys, torch
import torch._dynamo
mode = torch._dynamo.utils.get_optimize_ddp_mode()
import torch._dynamo.config as config
print(type(sys.modules["torch._dynamo"]).__name__, torch._dynamo is sys.modules["torch._dynamo"],
      config is torch._dynamo.config, mode)
print(torch.compile(lambda x: 2 * x + 1, backend="eager")(torch.ones(2)).tolist() == [3.0, 3.0])
print(type(sys.modules["torch._meta_registrations"]).__name__)
"""
    assert run(code, real=False) == ["module", "True", "True", "ddp_optimizer", "True", "module"]


def test_a_name_asked_of_the_meta_registrations_imports_them():
    code = """
import sys, torch
meta = sys.modules["torch._meta_registrations"]
print(type(meta).__name__, callable(torch._meta_registrations.activate_meta))
print(type(sys.modules["torch._meta_registrations"]).__name__,
      torch._meta_registrations is sys.modules["torch._meta_registrations"],
      torch.median(torch.empty(3, device="meta")).device)
"""
    assert run(code, real=False) == ["_Deferred", "True", "module", "True", "meta"]


def test_a_submodule_or_a_name_of_torch_export_imports_it():
    code = """
import sys, torch
print(type(sys.modules["torch.export"]).__name__)
import torch.export.dynamic_shapes as shapes        # a submodule first: the package's __path__
from torch.export import Dim
class M(torch.nn.Module):
    def forward(self, x):
        return 2 * x + 1
program = torch.export.export(M(), (torch.ones(2),))
print(type(sys.modules["torch.export"]).__name__, torch.export is sys.modules["torch.export"],
      shapes.Dim is Dim, program.module()(torch.ones(2)).tolist() == [3.0, 3.0])
"""
    assert run(code, real=False) == ["_Deferred", "module", "True", "True", "True"]
