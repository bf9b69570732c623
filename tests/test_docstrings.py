"""``help()`` on every public name of ``phalanx``, ``phalanx.torch``, ``phalanx.train`` and ``phalanx.jax`` stands alone.

Each names every argument of its signature (a class: those of ``__init__``), starts with one line of
semantics, and points nowhere else ("see the module docstring", "arguments as for ..."). The type
aliases and the base exception, whose whole meaning is in their docstring, say more than one line.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

import phalanx
from helpers import doc_problems

pytest.importorskip("torch")  # phalanx.torch and phalanx.train's names import torch when first used


def _public(module: str) -> list[str]:
    mod = importlib.import_module(module)
    return [f"{module}.{name}" for name in mod.__all__
            if inspect.isclass(getattr(mod, name)) or inspect.isfunction(getattr(mod, name))]


def _jax_names() -> list[str]:
    """phalanx.jax's own names (its re-exports of phalanx's are checked as phalanx's), where jax is installed."""
    try:
        import jax  # noqa: F401
    except ImportError:
        return []
    import phalanx.jax

    return [q for q in _public("phalanx.jax")
            if getattr(phalanx, q.rpartition(".")[2], None) is not getattr(phalanx.jax, q.rpartition(".")[2])]


PUBLIC = _public("phalanx") + _public("phalanx.torch") + _public("phalanx.train") + _jax_names()


def test_every_public_callable_is_checked() -> None:
    names = set(PUBLIC)
    assert {"phalanx.synchronize", "phalanx.iallreduce", "phalanx.Handle", "phalanx.train.evaluate",
            "phalanx.train.WandbLogger", "phalanx.train.ImageFolder", "phalanx.train.fit",
            "phalanx.torch.DistributedOptimizer", "phalanx.torch.DataParallel"} <= names


@pytest.mark.parametrize("qualname", PUBLIC)
def test_help_stands_alone_and_names_every_argument(qualname: str) -> None:
    module, _, name = qualname.rpartition(".")
    obj = getattr(importlib.import_module(module), name)
    problems = doc_problems(qualname, obj)
    assert not problems, "\n".join(problems)
    if module == "phalanx.torch":  # its wrappers and functions also say what they give back
        doc = inspect.getdoc(obj) or ""
        assert ":mod:`phalanx.torch._" not in doc, f"{qualname} points elsewhere"
        target = obj.__init__ if inspect.isclass(obj) else obj
        params = [p for p in inspect.signature(target).parameters if p != "self"]
        if params and name not in ("Replicas",):
            assert "Raises:" in doc or "Returns:" in doc, f"{qualname}: say what it returns or raises"


@pytest.mark.parametrize("name", ["BackendName", "Op", "PhalanxError"])
def test_aliases_and_the_base_error_explain_themselves(name: str) -> None:
    """A type alias or a base class has no signature to read: its docstring is all ``help()`` shows."""
    doc = inspect.getdoc(getattr(phalanx, name)) or ""
    paragraphs = [p for p in doc.split("\n\n") if p.strip()]
    assert len(paragraphs) >= 3 and "Example::" in doc, f"phalanx.{name}: a summary, what it covers and an example"
    assert not doc_problems(f"phalanx.{name}", getattr(phalanx, name))
    assert len(doc.splitlines()[0]) <= 110, doc.splitlines()[0]


@pytest.mark.parametrize("alias", ["BackendName", "Op"])
def test_a_literal_alias_names_every_value_it_allows(alias: str) -> None:
    import typing

    obj = getattr(phalanx, alias)
    doc = inspect.getdoc(obj) or ""
    missing = [v for v in typing.get_args(obj) if f'``"{v}"``' not in doc]
    assert not missing, f"phalanx.{alias}'s docstring does not describe {missing}"


def test_the_base_error_names_every_exported_subclass() -> None:
    doc = inspect.getdoc(phalanx.PhalanxError) or ""
    errors = [n for n in phalanx.__all__ if inspect.isclass(getattr(phalanx, n))
              and issubclass(getattr(phalanx, n), phalanx.PhalanxError) and n != "PhalanxError"]
    missing = [n for n in errors if f"``{n}``" not in doc]
    assert not missing, f"phalanx.PhalanxError's docstring does not list {missing}"
