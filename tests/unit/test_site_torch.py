"""tests/site/sitecustomize.py: the test run's ``torch._dynamo`` answers torch's two eager no-ops
without the import, its ``torch._meta_registrations``, ``torch.export``,
``torch._higher_order_ops``, ``torch.func`` and ``torch.compiler`` are not imported, none changes
a result, and each becomes the real module for anything else."""
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
      isinstance(g, torch.Generator), type(type(g)).__name__,
      *(type(sys.modules[n]).__name__
        for n in ("torch._higher_order_ops", "torch.func", "torch.compiler")),
      torch.compiler.is_compiling(), "torch._functorch.eager_transforms" in sys.modules)
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
                        "OpaqueBaseMeta", "_Deferred", "_Deferred", "_Deferred", "False",
                        "False"], "a real torch._dynamo, meta, export, hops, func or compiler"
    assert real == ["module", "True", "module", "module", "True", "True", "OpaqueBaseMeta",
                    "module", "module", "module", "False", "True"]
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


def test_torch_cond_vmap_and_the_compiler_give_the_real_modules_when_used():
    """``torch.vmap``/``torch.cond`` (bound by ``import torch`` from the deferred packages)
    compute as the real ones, importing them; a submodule of the deferred packages and any name
    of ``torch.compiler`` other than its eager questions import the real module. First,
    ``torch.testing.assert_close`` (DTensor's import: ``proxy_tensor`` before ``torch.fx.passes``,
    which the real ``torch.func`` would have imported) works."""
    code = """
import sys, torch
before = [type(sys.modules[n]).__name__
          for n in ("torch._higher_order_ops", "torch.func", "torch.compiler")]
x = torch.arange(6.0).reshape(2, 3)
batched = torch.vmap(lambda r: r.sum())(x).tolist()
branch = torch.cond(torch.tensor(True), lambda t: t + 1, lambda t: t - 1, (x,)).tolist()
from torch._higher_order_ops.utils import _in_hop_compile          # a submodule
print(*before, batched == [3.0, 12.0], branch == (x + 1).tolist(), callable(_in_hop_compile),
      torch.func.functional_call(torch.nn.Linear(3, 1, bias=False),
                                 {"weight": torch.ones(1, 3)}, (x,)).tolist() == [[3.0], [12.0]],
      callable(torch.compiler.disable), type(sys.modules["torch.compiler"]).__name__,
      type(sys.modules["torch.func"]).__name__, type(sys.modules["torch._higher_order_ops"]).__name__)
"""
    assert run(code, real=False) == ["_Deferred"] * 3 + ["True"] * 5 + ["module"] * 3
    code = """
import sys, torch
torch.testing.assert_close(torch.ones(2), torch.ones(2))
print("torch.fx.passes" in sys.modules, torch.vmap(lambda r: r.sum())(torch.ones(2, 3)).tolist())
"""
    assert run(code, real=False) == ["True", "[3.0,", "3.0]"]


def test_the_library_source_of_a_registration_is_torchs_string():
    """``torch._library.utils.get_source`` (the ``"file:line"`` torch.library keeps of each
    registration) gives the string torch's gives, from the frame alone."""
    code = """
import torch, torch._library.utils as u
def where():
    return u.get_source(2)
def caller():
    return where()
@torch.library.custom_op("hpctest::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return 2 * x
print(caller(), u.get_source.__module__, twice(torch.ones(2)).tolist() == [2.0, 2.0])
"""
    site, real = run(code, real=False), run(code, real=True)
    assert site == ["<string>:6", "sitecustomize", "True"], site
    assert real == ["<string>:6", "torch._library.utils", "True"], real
