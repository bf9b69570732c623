"""``help()`` on every public function and class of ``phalanx`` and ``phalanx.train`` stands alone.

Each names every argument of its signature (a class: those of ``__init__``), starts with one line of
semantics, and points nowhere else ("see the module docstring", "arguments as for ...").
"""

from __future__ import annotations

import importlib
import inspect

import pytest

from helpers import doc_problems

pytest.importorskip("torch")  # phalanx.train's names import torch when first used


def _public(module: str) -> list[str]:
    mod = importlib.import_module(module)
    return [f"{module}.{name}" for name in mod.__all__
            if inspect.isclass(getattr(mod, name)) or inspect.isfunction(getattr(mod, name))]


PUBLIC = _public("phalanx") + _public("phalanx.train")


def test_every_public_callable_is_checked() -> None:
    names = set(PUBLIC)
    assert {"phalanx.synchronize", "phalanx.iallreduce", "phalanx.Handle", "phalanx.train.evaluate",
            "phalanx.train.WandbLogger", "phalanx.train.ImageFolder", "phalanx.train.fit"} <= names


@pytest.mark.parametrize("qualname", PUBLIC)
def test_help_stands_alone_and_names_every_argument(qualname: str) -> None:
    module, _, name = qualname.rpartition(".")
    problems = doc_problems(qualname, getattr(importlib.import_module(module), name))
    assert not problems, "\n".join(problems)
