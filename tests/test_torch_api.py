"""``phalanx.torch``'s public signatures: string options are ``Literal`` types (``help()`` on each
name: tests/test_docstrings.py)."""

from __future__ import annotations

import typing

import pytest

pytest.importorskip("torch")

import phalanx.torch as pt  # noqa: E402


@pytest.mark.parametrize("wrapper", ["DistributedOptimizer", "DataParallel"])
def test_string_options_are_literal_types(wrapper: str) -> None:
    hints = typing.get_type_hints(getattr(pt, wrapper).__init__)
    for option, values in (("op", {"avg", "sum"}), ("compression", {"bf16", "fp16", "powersgd", pt.PowerSGD, None}),
                           ("nonfinite", {"raise", "skip", None})):
        args = set()
        for arg in typing.get_args(hints[option]) or (hints[option],):
            args |= set(typing.get_args(arg)) if typing.get_origin(arg) is typing.Literal else {arg}
        assert {None if a is type(None) else a for a in args} == values, (wrapper, option, hints[option])
