"""User code in ``hpcasync train`` (:mod:`hpcasync.plugins`), in one process: spec parsing, the
conversion of a user data set, the optimizer keywords, ``evaluate`` with a loss. (Bad user code
and the plugins trained end to end: tests/mpi/test_plugins.py.)"""
from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

from hpcasync.errors import ConfigError, DataError


def test_parse_spec_forms():
    from hpcasync.plugins import is_spec, parse_spec

    assert parse_spec("pkg.mod:make", "--model") == ("pkg.mod", "make")
    assert parse_spec("sub/dir/file.py:Nets.small", "--model") == ("sub/dir/file.py", "Nets.small")
    assert not is_spec("lenet") and is_spec("m:f")
    for bad, needle in [(":f", "expected MODULE:FACTORY"), ("m:", "expected MODULE:FACTORY"),
                        ("m:1x", "not a (dotted) Python name"),
                        ("my-mod:f", "neither a dotted module name")]:
        with pytest.raises(ConfigError) as info:
            parse_spec(bad, "--model")
        assert str(info.value).startswith(f"--model {bad}: ") and needle in str(info.value)


class _Pairs(Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_user_dataset_conversion(tmp_path, monkeypatch):
    from hpcasync.data import load_dataset

    monkeypatch.chdir(tmp_path)
    _write(tmp_path, "seqdata.py", """
        import numpy as np
        import torch
        from torch.utils.data import Dataset, TensorDataset

        class Items(Dataset):
            def __init__(self, n, seed):
                g = torch.Generator().manual_seed(seed)
                self.x = torch.randn(n, 5, 3, generator=g, dtype=torch.float64)
            def __len__(self):
                return len(self.x)
            def __getitem__(self, i):
                return self.x[i], (np.int32(i % 4) if i % 2 else torch.tensor(i % 4))

        def make():
            return Items(10, 0), Items(6, 1)

        def tensors():
            return (TensorDataset(torch.randn(7, 2), torch.tensor([0, 1, 2, 0, 1, 2, 5])),
                    TensorDataset(torch.randn(3, 2), torch.tensor([0, 1, 1])))
        """)
    train, test = load_dataset("seqdata:make", train_limit=8)
    assert (len(train), len(test), train.input_shape, train.num_classes) == (8, 6, (5, 3), 4)
    assert train.images.dtype == torch.float32 and train.labels.dtype == torch.int64
    assert train.labels.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    train, test = load_dataset("seqdata.py:tensors")          # a file spec, TensorDatasets
    assert train.num_classes == 6 and test.num_classes == 6 and train.input_shape == (2,)


def test_user_dataset_item_errors(tmp_path, monkeypatch):
    from hpcasync.data import user

    bad = {"empty": (TensorDataset(torch.zeros(0, 2), torch.zeros(0, dtype=torch.long)),),
           "bool-label": ([(torch.zeros(2), True)],),
           "float-x-int": ([(torch.zeros(2, dtype=torch.long), 1)],),
           "shapes": ([(torch.zeros(2), 1), (torch.zeros(3), 0)],),
           "one-class": ([(torch.zeros(2), 0)],)}
    needles = {"empty": "train set is empty", "bool-label": "label must be an int >= 0",
               "float-x-int": "x must be a floating tensor", "shapes": "same shape",
               "one-class": "at least 2 classes"}
    for key, (train,) in bad.items():
        train = train if isinstance(train, Dataset) else _Pairs(train)
        monkeypatch.setattr(user, "load_factory", lambda spec, what, t=train: lambda: (t, t))
        with pytest.raises(DataError, match=needles[key]):
            user.user_dataset("x:y")


def test_make_optimizer_and_loss():
    from hpcasync.plugins import make_loss, make_optimizer

    params = [torch.nn.Parameter(torch.zeros(3))]
    kw = {"lr": 0.01, "momentum": 0.5, "weight_decay": 0.1}
    sgd = make_optimizer("sgd", params, **kw)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.5
    adam = make_optimizer("adam", params, **kw)           # no momentum keyword for Adam
    assert isinstance(adam, torch.optim.Adam) and adam.defaults["weight_decay"] == 0.1
    assert make_optimizer("rmsprop", params, **kw).defaults["momentum"] == 0.5
    assert make_optimizer("adamw", params, **kw).defaults["lr"] == 0.01
    with pytest.raises(ConfigError, match="not one of: sgd, adam, adamw, rmsprop"):
        make_optimizer("lbfgs", params, **kw)
    with pytest.raises(ConfigError, match="torch.optim.SGD raised ValueError"):
        make_optimizer("sgd", params, lr=-1.0, momentum=0.0, weight_decay=0.0)
    assert make_loss() is F.cross_entropy and make_loss("nll") is F.nll_loss


def test_evaluate_with_a_loss():
    from hpcasync.data import ArrayDataset
    from hpcasync.runtime.context import evaluate

    torch.manual_seed(0)
    data = ArrayDataset(torch.randn(50, 4), torch.arange(50) % 3, num_classes=3)
    model = torch.nn.Linear(4, 3)
    loss, acc = evaluate(model, data, batch_size=16)
    with torch.no_grad():
        out = model(data.images)
    assert loss == pytest.approx(float(F.cross_entropy(out, data.labels)), rel=1e-6)
    mse = evaluate(model, data, batch_size=16, loss_fn=lambda o, y: (o ** 2).mean())[0]
    assert mse == pytest.approx(float((out ** 2).mean()), rel=1e-5)
    assert evaluate(model, data, batch_size=16, loss_fn=F.cross_entropy) == (loss, acc)
