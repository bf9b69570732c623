"""The error contract: every error a user can meet is a phalanx error, defined in one place.

A scan of ``src/`` (with ``ast``) keeps plain built-in raises and bare
``PhalanxError`` from coming back; the two calls the reliability run found
raising ``builtins.ValueError`` (an unknown op, a bad root) are checked directly.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import numpy as np
import pytest

import phalanx
from phalanx import _errors

SRC = Path(phalanx.__file__).parent
BANNED = {"ValueError", "TypeError", "RuntimeError", "KeyError", "PhalanxError"}

# Raises of banned exceptions that never reach a user, each with why. Keyed by (path, exception).
ALLOWED_RAISES: dict[tuple[str, str], str] = {}

# Exception classes defined outside _errors.py: internal signals that never reach a user.
ALLOWED_CLASSES = {
    ("comm/_base.py", "WaitTimeout"): "a backend's wait passed its deadline; World.guard makes it "
                                      "CollectiveTimeoutError",
    ("comm/_base.py", "PeerLost"): "a backend saw a dead peer; World.guard makes it RankFailedError",
    ("comm/_base.py", "DiagnosisUnavailable"): "caught by the timeout diagnosis, which says so in "
                                               "the CollectiveTimeoutError",
    ("train/_policy.py", "NonFiniteLoss"): "caught by fit's step loop, which applies the failure policy",
    ("train/_elastic_fit.py", "GrowRequested"): "raised between fit's steps when every rank agreed to admit a "
                                                "replacement; caught by fit's elastic loop, which re-forms the world",
    ("testing/__init__.py", "WorldFailed"): "a failed test world for pytest: an AssertionError (a test failure, with every "
                                   "rank's output), not an error of the API",
}


def _modules() -> list[tuple[str, ast.Module]]:
    return [(str(p.relative_to(SRC)), ast.parse(p.read_text(), str(p))) for p in sorted(SRC.rglob("*.py"))]


def _raised_name(node: ast.Raise) -> str | None:
    exc = node.exc
    if isinstance(exc, ast.Call):
        exc = exc.func
    if isinstance(exc, ast.Name):
        return exc.id
    if isinstance(exc, ast.Attribute):
        return exc.attr
    return None


def test_src_raises_no_builtin_or_bare_phalanx_error() -> None:
    found = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and _raised_name(node) in BANNED:
                if (path, _raised_name(node)) not in ALLOWED_RAISES:
                    found.append(f"{path}:{node.lineno}: raise {_raised_name(node)}")
    assert not found, ("raise a PhalanxError subclass from _errors.py (naming the call, the value and "
                       "the fix) instead of:\n" + "\n".join(found))


def test_exception_classes_are_defined_only_in_errors_module() -> None:
    found = []
    for path, tree in _modules():
        if path in ("_errors.py", "horovod/_errors.py"):  # phalanx's errors; the Horovod layer's, by Horovod's names
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                    (isinstance(b, ast.Name) and (b.id.endswith(("Error", "Exception")) or b.id in BANNED))
                    or (isinstance(b, ast.Attribute) and b.attr.endswith(("Error", "Exception")))
                    for b in node.bases) and (path, node.name) not in ALLOWED_CLASSES:
                found.append(f"{path}:{node.lineno}: class {node.name}")
    assert not found, "define exceptions in _errors.py:\n" + "\n".join(found)


def test_every_error_subclasses_phalanx_error_and_is_exported() -> None:
    for name in _errors.__all__:
        cls = getattr(_errors, name)
        assert inspect.isclass(cls) and issubclass(cls, phalanx.PhalanxError), name
        assert getattr(phalanx, name, None) is cls and name in phalanx.__all__, f"phalanx.{name} is not exported"
        if cls is not phalanx.PhalanxError:
            builtin = [b for b in cls.__mro__[1:] if b.__module__ == "builtins" and b not in (Exception,
                                                                                           BaseException, object)]
            assert builtin, f"{name} subclasses no built-in exception (e.g. ValueError) besides Exception"


@pytest.fixture
def world_of_one():
    phalanx.init("local")
    yield
    phalanx.shutdown()


def test_unknown_op_is_a_phalanx_value_error_naming_call_value_and_fix(world_of_one) -> None:
    with pytest.raises(phalanx.PhalanxError) as raised:
        phalanx.allreduce(np.ones(2), op="mean")
    error = raised.value
    assert isinstance(error, ValueError)
    text = str(error)
    assert "phalanx.allreduce" in text and "'mean'" in text and "'avg'" in text, text


@pytest.mark.parametrize("root", [1, -1, 1.0, True])
def test_bad_root_is_a_phalanx_value_error_naming_call_value_and_fix(world_of_one, root) -> None:
    with pytest.raises(phalanx.PhalanxError) as raised:
        phalanx.broadcast(np.ones(2), root=root)
    error = raised.value
    assert isinstance(error, ValueError)
    text = str(error)
    assert "phalanx.broadcast" in text and f"root={root!r}" in text and "root=0" in text, text


def test_bad_settings_are_phalanx_errors_naming_the_variable(monkeypatch) -> None:
    from phalanx._settings import Settings

    for name, value in (("PHALANX_TIMEOUT", "soon"), ("PHALANX_TIMEOUT", "-3"), ("PHALANX_TIMEOUT", "inf"),
                        ("PHALANX_TIMEOUT", "nan"), ("PHALANX_CHECK", "maybe")):
        monkeypatch.setenv(name, value)
        with pytest.raises(phalanx.InvalidSettingError, match=name) as raised:
            Settings()
        assert isinstance(raised.value, ValueError)
        monkeypatch.delenv(name)


def test_bad_backend_and_timeout_are_phalanx_value_errors() -> None:
    with pytest.raises(phalanx.InvalidArgumentError, match=r"phalanx.init\(backend='tcp'\): unknown backend") as raised:
        phalanx.init("tcp")  # type: ignore[arg-type]
    assert isinstance(raised.value, ValueError) and not phalanx.initialized()
    with pytest.raises(phalanx.InvalidArgumentError, match=r"phalanx.init\(timeout=0\).*positive") as raised:
        phalanx.init("local", timeout=0)
    assert isinstance(raised.value, ValueError) and not phalanx.initialized()
    for endless in (float("inf"), float("nan")):
        with pytest.raises(phalanx.InvalidArgumentError, match=rf"phalanx.init\(timeout={endless}\).*finite"):
            phalanx.init("local", timeout=endless)
        assert not phalanx.initialized()


def test_an_endless_timeout_set_in_code_is_a_setting_error(monkeypatch) -> None:
    monkeypatch.setattr(phalanx.settings, "timeout", float("inf"))
    with pytest.raises(phalanx.InvalidSettingError, match=r"phalanx.settings.timeout=inf.*finite"):
        phalanx.init("local")
