"""Bodies for tests/test_state_transfer.py: a training state sent from one rank to every rank.

The last rank sends a state shaped like ``fit(elastic=True)``'s (a module's ``state_dict`` with its
``_metadata``, an Adam state, plain values, the RNG state) plus the awkward tensors (bfloat16, bool,
0-dim, empty, non-contiguous, a Parameter, a sparse tensor kept in the structure); every rank must
hold an equal state afterwards, with the received tensors in buffers of their own.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import phalanx
from behaviours import Behaviours

STATE = Behaviours()


def _state() -> dict[str, Any]:
    import torch

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7), torch.nn.Linear(7, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    odd = torch.arange(24, dtype=torch.float64).reshape(4, 6)[:, ::2]  # non-contiguous
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "odd": {"bf16": torch.randn(3, dtype=torch.bfloat16), "bool": torch.tensor([True, False, True]),
                "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4), "strided": odd,
                "parameter": torch.nn.Parameter(torch.ones(2)), "sparse": torch.eye(3).to_sparse(),
                "nested": [1, "two", (3.0, torch.arange(3))], "none": None},
        "rng": torch.get_rng_state(),
        "step": 7,
    }


def _equal(a: Any, b: Any, where: str = "state") -> None:
    import torch

    assert type(a) is type(b) or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)), \
        (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        a, b = (t.to_dense() if t.layout != torch.strided else t for t in (a, b))
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (where, a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b), (where, list(a), list(b))
        for k in a:
            _equal(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@STATE.behaviour("every-rank-holds-the-senders-state-equal-in-structure-dtype-shape-and-value")
def _(r: int, n: int) -> None:
    from phalanx.train._state_transfer import broadcast_state

    got, sent = broadcast_state(_state() if r == n - 1 else None, n - 1, r)
    _equal(got, _state())
    assert sent > 0


@STATE.behaviour("a-module-state-dict-keeps-its-metadata-and-loads-into-a-fresh-model")
def _(r: int, n: int) -> None:
    import torch

    from phalanx.train._state_transfer import broadcast_state

    got, _ = broadcast_state(_state() if r == n - 1 else None, n - 1, r)
    assert isinstance(got["model"], OrderedDict) and hasattr(got["model"], "_metadata"), type(got["model"])
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7), torch.nn.Linear(7, 2))
    model.load_state_dict(got["model"])
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    opt.load_state_dict(got["optimizer"])
    opt.step()  # Adam's moments received in place are writable


@STATE.behaviour("the-bytes-sent-are-the-tensors-and-a-small-header")
def _(r: int, n: int) -> None:
    import torch

    from phalanx.train._state_transfer import broadcast_state

    big = {"model": {"w": torch.ones(1_000_000)}}  # 4 MB
    _, sent = broadcast_state(big if r == 0 else None, 0, r)
    assert 4_000_000 <= sent < 4_000_000 + 4096, sent


def state_transfer() -> dict[str, str | None]:
    return STATE.run(phalanx.rank(), phalanx.size())
