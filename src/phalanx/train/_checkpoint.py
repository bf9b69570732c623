"""Checkpoint files: written atomically on rank 0 with a SHA-256 footer, read and verified by every rank.

A file is ``torch.save``'s output followed by an 80-byte footer,
``b"\\0PHALANX-SHA256 "`` and the hex SHA-256 of every byte before it.
:func:`load_checkpoint` checks the digest before unpickling anything (weights
only), so a damaged file is a :class:`~phalanx.CheckpointError` naming it,
never a silently different model. The write goes through
:func:`phalanx._files.write_atomically`, whose ``check`` re-reads the
temporary file (digest and a weights-only load) before it replaces the target.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import pickletools
import re
import zipfile
from collections.abc import Mapping
from typing import IO, Any

import numpy as np
import torch

from .._collectives import broadcast
from .._errors import CheckpointError, InvalidArgumentError
from .._files import write_atomically
from ._state import check_format, fspath, identity, unstorable

__all__ = ["load_checkpoint", "save_checkpoint", "verify_digest"]

_STATUS_BYTES = 1024  # rank 0's outcome of a save, broadcast to every rank: [failed, utf-8 message...]
_SUFFIXES = (".pt", ".pth", ".ckpt", ".tar", ".bin")
_MARKER = b"\0PHALANX-SHA256 "
_FOOTER = len(_MARKER) + 64
_CHUNK = 1 << 20


# -- the digest footer -----------------------------------------------------------------------------

def _hash(f: IO[bytes], length: int) -> str:
    digest = hashlib.sha256()
    f.seek(0)
    left = length
    while left > 0:
        chunk = f.read(min(_CHUNK, left))
        if not chunk:
            break
        digest.update(chunk)
        left -= len(chunk)
    return digest.hexdigest()


def _append_digest(f: IO[bytes]) -> None:
    """Append the footer to ``f`` (opened for writing and reading back), which holds torch.save's output."""
    f.flush()
    length = f.seek(0, os.SEEK_END)
    with open(f.name, "rb") as back:
        hexdigest = _hash(back, length)
    f.seek(0, os.SEEK_END)
    f.write(_MARKER + hexdigest.encode("ascii"))


def verify_digest(path: str, where: str) -> bool:
    """Check ``path``'s footer: True when it verifies, False when there is none; CheckpointError when
    the bytes do not match it (the file was damaged after it was written)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size < _FOOTER:
            return False
        f.seek(size - _FOOTER)
        footer = f.read(_FOOTER)
        if not footer.startswith(_MARKER):
            return False
        expected = footer[len(_MARKER):].decode("ascii", errors="replace")
        actual = _hash(f, size - _FOOTER)
    if actual != expected:
        raise CheckpointError(
            f"{where}: the file is damaged: its SHA-256 digest does not match the one written with it "
            f"(expected {expected[:16]}..., found {actual[:16]}...). It was changed after phalanx wrote it "
            "(disk or copy error); use an older checkpoint (CheckpointManager and fit(resume='latest') "
            "fall back to one by themselves)."
        )
    return True


# -- writing ---------------------------------------------------------------------------------------

def _write(target: str, state: Any) -> None:
    """Rank 0's atomic write; raises CheckpointError/OSError on failure, leaving the old file as it was."""
    call = "phalanx.train.save_checkpoint"
    check_format(state, f"{call}: the state")
    bad = unstorable(state, "state")
    if bad:
        raise CheckpointError(
            f"{call}({target!r}): {bad}, which load_checkpoint (torch.load with weights_only=True) would "
            "refuse. Checkpoints hold tensors, numbers, strings and plain dicts/lists/tuples only."
        )

    def loads_back(temp: str) -> None:  # mmap: no second copy of the tensors in memory
        try:
            if not verify_digest(temp, call):
                raise CheckpointError("no digest footer")
            torch.load(temp, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            raise CheckpointError(f"{call}({target!r}): the file written does not load back ({exc})") from exc

    with write_atomically(target, check=loads_back) as f:
        torch.save(state, f)
        _append_digest(f)


def save_checkpoint(path: str | os.PathLike[str], state: Mapping[str, Any]) -> str:
    """Write a training state to ``path`` atomically on rank 0, with a SHA-256 footer; returns ``path``.

    **Collective** when phalanx is initialized with more than one rank: every
    rank calls it and only rank 0's ``state`` is written (other ranks may pass
    theirs or ``None``). Rank 0 writes a temporary file beside ``path``,
    fsyncs it, reads it back (digest and a weights-only load) and renames it
    onto ``path``; a crash at any moment leaves the previous file or the new
    one, never a mixture. Parent directories are created. The other ranks wait
    for rank 0's outcome within the collective timeout (``PHALANX_TIMEOUT``),
    which must therefore cover writing the file.

    Arguments:
        path: the file to write (any name; :class:`CheckpointManager` numbers them for you).
        state: from :func:`capture_state`.

    Returns:
        ``path``, as a string, on every rank.

    Raises:
        CheckpointError: on every rank alike when rank 0 could not write (read-only directory, disk
            full, an object ``load_checkpoint`` would refuse, named by where it sits in ``state``); the
            previous file at ``path`` is unchanged and no temporary file is left.
    """
    call = "save_checkpoint"
    r, n = identity()
    error: BaseException | None = None
    target = ""
    try:
        target = fspath(path, call)
    except InvalidArgumentError as exc:
        error = exc
    if r == 0 and error is None:
        try:
            _write(target, state)
        except CheckpointError as exc:
            error = exc
        except Exception as exc:
            error = CheckpointError(
                f"phalanx.train.{call}({target!r}): rank 0 could not write the checkpoint "
                f"({type(exc).__name__}: {exc}). The previous file at that path, if any, is unchanged. "
                "Check that the directory is writable and has free space."
            )
            error.__cause__ = exc
    if n > 1:
        status = np.zeros(_STATUS_BYTES, dtype=np.uint8)
        if r == 0 and error is not None:
            message = str(error).encode("utf-8")[:_STATUS_BYTES - 1]
            status[0] = 1
            status[1:1 + len(message)] = np.frombuffer(message, dtype=np.uint8)
        status = broadcast(status, root=0)
        if r != 0 and status[0] and error is None:
            reason = bytes(status[1:]).rstrip(b"\0").decode("utf-8", errors="ignore")
            error = CheckpointError(f"phalanx.train.{call}: rank 0 failed to write the checkpoint, so no rank "
                                    f"has a new one. Rank 0 reported: {reason}")
    if error is not None:
        raise error
    return target


# -- reading ---------------------------------------------------------------------------------------

def _listing(directory: str) -> str:
    try:
        names = sorted(
            name for name in os.listdir(directory)
            if not name.startswith(".") and name.endswith(_SUFFIXES)
            and os.path.isfile(os.path.join(directory, name))
        )
    except FileNotFoundError:
        return f"the directory {directory!r} does not exist"
    except OSError as exc:
        return f"the directory {directory!r} cannot be listed ({exc})"
    if not names:
        return f"{directory!r} holds no checkpoint files ({', '.join('*' + s for s in _SUFFIXES)})"
    shown = ", ".join(names[-10:])
    more = f" (the newest 10 of {len(names)})" if len(names) > 10 else ""
    return f"checkpoints in {directory!r}{more}: {shown}"


_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING",
               "SHORT_BINSTRING"}
_SCAN_LIMIT = 64 << 20


def _pickle_globals(target: str) -> list[str] | None:
    """The globals a pickle names, read without unpickling (pickletools); None if it does not parse."""
    try:
        if zipfile.is_zipfile(target):
            with zipfile.ZipFile(target) as archive:
                member = next((n for n in archive.namelist() if n.endswith("data.pkl")), None)
                if member is None or archive.getinfo(member).file_size > _SCAN_LIMIT:
                    return None
                data = archive.read(member)
        else:
            if os.path.getsize(target) > _SCAN_LIMIT:
                return None
            with open(target, "rb") as f:
                data = f.read()
        names: list[str] = []
        strings: list[str] = []
        for op, arg, _ in pickletools.genops(data):
            if op.name in ("GLOBAL", "INST"):
                names.append(str(arg).replace(" ", "."))
            elif op.name == "STACK_GLOBAL":
                names.append(".".join(strings[-2:]) if len(strings) >= 2 else "an object")
            elif op.name in _STRING_OPS:
                strings.append(str(arg))
        return list(dict.fromkeys(names))
    except Exception:
        return None


def load_checkpoint(path: str | os.PathLike[str], map_location: Any = "cpu") -> dict[str, Any]:
    """Read and verify a checkpoint written by :func:`save_checkpoint`. Not collective.

    Every rank reads the file itself, so it must be on a filesystem every rank
    sees. The file's SHA-256 footer is checked before anything is unpickled,
    and the data is read with ``torch.load(weights_only=True)``: tensors,
    numbers, strings and plain containers only.

    Arguments:
        path: the checkpoint file.
        map_location: where tensors go (``torch.load``'s argument), ``"cpu"`` by default.

    Returns:
        The state dict (see :func:`capture_state`), ready for :func:`restore_state`.

    Raises:
        CheckpointError: naming the file: missing (the message lists the checkpoints that do exist
            there), damaged (the digest does not match, or the footer is gone), truncated or of another
            format ("not a complete phalanx checkpoint"), or holding objects other than tensors and
            plain containers ("refused as unsafe": it is never unpickled).
    """
    call = "load_checkpoint"
    target = fspath(path, call)
    where = f"phalanx.train.{call}({target!r})"
    if not os.path.exists(target):
        raise CheckpointError(f"{where}: no such file; {_listing(os.path.dirname(target) or '.')}.")
    if os.path.isdir(target):
        raise CheckpointError(f"{where}: this is a directory; pass a checkpoint file "
                              "(e.g. CheckpointManager(directory).latest()).")
    try:
        verified = verify_digest(target, where)
    except OSError as exc:
        raise CheckpointError(f"{where}: cannot read the file ({exc}).") from exc
    state = _torch_load(target, where, map_location)
    check_format(state, where)
    if not verified and state["version"] >= 2:
        raise CheckpointError(
            f"{where}: the file is damaged: it lacks the SHA-256 footer every checkpoint of format version "
            f"{state['version']} ends with (it was cut short or overwritten after phalanx wrote it). Use an "
            "older checkpoint (CheckpointManager and fit(resume='latest') fall back to one by themselves)."
        )
    return state


def _torch_load(target: str, where: str, map_location: Any) -> Any:
    """``torch.load(weights_only=True)`` with every failure turned into a CheckpointError naming the file."""
    try:
        return torch.load(target, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        error = _unpickling_error(target, where, exc)
        raise error from (None if "refused as unsafe" in str(error) else exc)
    except (PermissionError, IsADirectoryError) as exc:
        raise CheckpointError(f"{where}: cannot read the file ({exc}).") from exc
    except Exception as exc:
        detail = str(exc).split(". ")[0] or type(exc).__name__
        raise CheckpointError(
            f"{where}: not a complete phalanx checkpoint: the file is truncated or corrupt "
            f"({type(exc).__name__}: {detail}). A crash during a phalanx save cannot cause this (writes are "
            "atomic); the file was damaged or written by something else."
        ) from exc


def _unpickling_error(target: str, where: str, exc: pickle.UnpicklingError) -> CheckpointError:
    text = str(exc)
    if "Weights only load failed" not in text:
        return CheckpointError(f"{where}: not a complete phalanx checkpoint (corrupt: {text})")
    found = sorted(set(re.findall(r"GLOBAL ([\w.]+)", text)))
    if not found:
        # "Unsupported operand": a damaged pickle, or a well-formed one using what weights-only refuses
        scanned = _pickle_globals(target)
        if scanned is None:
            return CheckpointError(
                f"{where}: not a complete phalanx checkpoint: the file is corrupt (its pickle data does not "
                "parse)."
            )
        found = [name for name in scanned if not name.startswith(("torch.", "collections."))]
    what = f" ({', '.join(found[:5])}{', ...' if len(found) > 5 else ''})" if found else ""
    return CheckpointError(
        f"{where}: refused as unsafe: the file holds objects other than tensors and plain "
        f"containers{what}, which could run arbitrary code when unpickled. phalanx loads "
        "checkpoints with torch.load(weights_only=True) only; inspect the file yourself "
        "(torch.load(path, weights_only=False)) only if you trust where it came from."
    )
