"""``phalanx.torch``'s public names document themselves: ``help()`` on each stands alone."""

from __future__ import annotations

import inspect
import typing

import pytest

pytest.importorskip("torch")

import phalanx.torch as pt  # noqa: E402
from helpers import doc_problems  # noqa: E402

PUBLIC = [name for name in pt.__all__ if inspect.isclass(getattr(pt, name)) or inspect.isfunction(getattr(pt, name))]


@pytest.mark.parametrize("name", PUBLIC)
def test_help_stands_alone_and_names_every_argument(name: str) -> None:
    obj = getattr(pt, name)
    doc = inspect.getdoc(obj) or ""
    problems = doc_problems(name, obj)
    assert not problems, "\n".join(problems)
    assert ":mod:`phalanx.torch._" not in doc, f"{name} points elsewhere"
    target = obj.__init__ if inspect.isclass(obj) else obj
    params = [p for p in inspect.signature(target).parameters if p != "self"]
    if params and name not in ("Replicas",):
        assert "Raises:" in doc or "Returns:" in doc, f"{name}: say what it returns or raises"


@pytest.mark.parametrize("wrapper", ["DistributedOptimizer", "DataParallel"])
def test_string_options_are_literal_types(wrapper: str) -> None:
    hints = typing.get_type_hints(getattr(pt, wrapper).__init__)
    for option, values in (("op", {"avg", "sum"}), ("compression", {"bf16", "fp16", "powersgd", pt.PowerSGD, None}),
                           ("nonfinite", {"raise", "skip", None})):
        args = set()
        for arg in typing.get_args(hints[option]) or (hints[option],):
            args |= set(typing.get_args(arg)) if typing.get_origin(arg) is typing.Literal else {arg}
        assert {None if a is type(None) else a for a in args} == values, (wrapper, option, hints[option])
