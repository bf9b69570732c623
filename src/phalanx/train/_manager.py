"""``CheckpointManager``: numbered checkpoints in a directory, pruned, with a fallback that every rank agrees on."""

from __future__ import annotations

import os
import re
import shutil
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np

from .._collectives import allgather, broadcast
from .._errors import CheckpointError, InvalidArgumentError
from ._checkpoint import load_checkpoint, save_checkpoint
from ._state import fspath, identity

__all__ = ["CheckpointManager"]

T = TypeVar("T")


class CheckpointManager:
    """A directory of numbered checkpoints: ``<prefix>-<step:09d>.pt``, the newest ``keep`` kept.

    ::

        manager = CheckpointManager("ckpt", keep=3)
        manager.save(capture_state(model=model, optimizer=opt, progress=progress), step=1200)
        state = manager.load_latest()      # None before the first save

    Arguments:
        directory: where the checkpoints go (created on the first save).
        keep: how many checkpoints to keep (an int >= 1), or ``None`` to keep all. After each save,
            rank 0 deletes the older ones and temporary files left by interrupted saves.
        prefix: the file-name prefix, letters, digits, ``_``, ``-`` and ``.``.

    ``save`` and ``load_latest`` are **collective** in a multi-rank world: every
    rank calls them. ``load_latest`` verifies each file's digest and falls back
    to the next older checkpoint, on every rank alike, when any rank cannot load
    the newest. Raises :class:`InvalidArgumentError` for a bad ``keep`` or ``prefix``.
    """

    def __init__(self, directory: str | os.PathLike[str], *, keep: int | None = 3,
                 prefix: str = "checkpoint") -> None:
        call = "CheckpointManager"
        self.directory = fspath(directory, call)
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
            raise InvalidArgumentError(
                f"phalanx.train.{call}(keep={keep!r}): keep is how many checkpoints to keep, an int >= 1 "
                "(or None to keep all)."
            )
        if not isinstance(prefix, str) or not re.fullmatch(r"[\w\-][\w.\-]*", prefix):
            raise InvalidArgumentError(
                f"phalanx.train.{call}(prefix={prefix!r}): use a plain file-name prefix of letters, digits, "
                "'_', '-' and '.' (not starting with '.'), e.g. 'checkpoint'."
            )
        self.keep = keep
        self.prefix = prefix
        self._complete = re.compile(rf"{re.escape(prefix)}-(\d{{9,}})\.pt")
        self._temporary = re.compile(rf"\.{re.escape(prefix)}-\d+\.pt\.tmp-\d+")
        self._shards = re.compile(rf"({re.escape(prefix)}-\d{{9,}}\.pt)\.shards(?:\.(?:tmp|old)-[0-9a-f]+)?")

    def __repr__(self) -> str:
        return f"CheckpointManager({self.directory!r}, keep={self.keep!r}, prefix={self.prefix!r})"

    def path(self, step: int) -> str:
        """The file name of step ``step``'s checkpoint."""
        if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
            raise InvalidArgumentError(
                f"phalanx.train.CheckpointManager.save(step={step!r}): step must be an int >= 0 "
                "(the global step or epoch the checkpoint belongs to)."
            )
        return os.path.join(self.directory, f"{self.prefix}-{int(step):09d}.pt")

    def save(self, state: Mapping[str, Any], step: int) -> str:
        """Write ``state`` as step ``step``'s checkpoint (collective); prune on rank 0; return its path."""
        target = save_checkpoint(self.path(step), state)
        if identity()[0] == 0:
            self._prune(target)
        return target

    def _prune(self, just_saved: str) -> None:
        doomed = []
        if self.keep is not None:
            doomed = [p for p in self.paths()[:-self.keep] if os.path.abspath(p) != os.path.abspath(just_saved)]
        try:
            names = os.listdir(self.directory)
        except OSError:
            names = []
        doomed += [os.path.join(self.directory, n) for n in names if self._temporary.fullmatch(n)]
        # a parameter-sharded checkpoint's shard directory goes with its file; one whose file was never
        # written (a save that stopped before its commit) goes too
        kept = {os.path.basename(p) for p in self.paths() if p not in doomed}
        doomed += [os.path.join(self.directory, n) for n in names
                   if (m := self._shards.fullmatch(n)) and m.group(1) not in kept
                   and os.path.join(self.directory, n) != just_saved + ".shards"]
        for path in doomed:
            try:
                if os.path.isdir(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                warnings.warn(f"phalanx.train.CheckpointManager: could not delete {path!r} ({exc}).",
                              RuntimeWarning, stacklevel=3)

    def paths(self) -> list[str]:
        """Complete checkpoints in the directory, oldest (lowest step) first."""
        return [self.path(step) for step in self._steps()]

    def _steps(self) -> list[int]:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for m in map(self._complete.fullmatch, names) if m)

    def latest(self) -> str | None:
        """The newest checkpoint's path, or ``None`` when there is none."""
        paths = self.paths()
        return paths[-1] if paths else None

    def load_latest(self, map_location: Any = "cpu") -> dict[str, Any] | None:
        """The newest checkpoint every rank can load, or ``None`` when there is none. Collective.

        A checkpoint that any rank cannot load (damaged: digest mismatch; truncated; missing on that
        rank's filesystem) is skipped on every rank, with a warning naming the file, the rank(s) and
        the reason, and the next older one is tried. ``map_location``: where tensors go
        (``torch.load``'s argument), ``"cpu"`` by default.
        Raises :class:`CheckpointError` on every rank when none of them can be loaded.
        """
        found = self.first_good(lambda state: state, map_location=map_location)
        return None if found is None else found[1]

    def first_good(self, use: Callable[[dict[str, Any]], T], *,
                   map_location: Any = "cpu") -> tuple[str, T] | None:
        """``(path, use(state))`` for the newest checkpoint that loads and that ``use`` accepts on every
        rank (``use`` raising :class:`CheckpointError` on any rank means: try the next older one, on
        every rank). ``None`` when there is no checkpoint. Collective in a multi-rank world: the
        candidates are rank 0's listing, and the ranks agree after each one."""
        r, n = identity()
        paths = self._agreed_paths(n)
        failures: list[str] = []
        for path in reversed(paths):
            result: Any = None
            reason = ""
            try:
                result = use(load_checkpoint(path, map_location=map_location))
            except CheckpointError as exc:
                reason = str(exc)
            failed = [r] if reason else []
            if n > 1:
                flags = np.asarray(allgather(np.array([1 if reason else 0], dtype=np.int64)))
                failed = [int(q) for q in np.flatnonzero(flags[:, 0])]
            if not failed:
                return path, result
            text = f"{path!r} on rank(s) {failed}" + (f": {reason}" if reason else " (this rank loaded it)")
            failures.append(text)
            warnings.warn(f"phalanx.train.CheckpointManager: skipped {text}; falling back to an older "
                          "checkpoint on every rank.", RuntimeWarning, stacklevel=3)
        if failures:
            raise CheckpointError(
                f"phalanx.train.CheckpointManager.load_latest: none of the {len(paths)} checkpoint(s) in "
                f"{self.directory!r} can be loaded on every rank:\n  " + "\n  ".join(failures)
            )
        return None

    def _agreed_paths(self, n: int) -> list[str]:
        """This directory's checkpoints as rank 0 lists them (every rank gets the same list)."""
        steps = self._steps()
        if n > 1:
            count = int(broadcast(np.array([len(steps)], dtype=np.int64), root=0)[0])
            mine = np.zeros(count, dtype=np.int64)
            if identity()[0] == 0:
                mine[:] = steps
            steps = [int(s) for s in broadcast(mine, root=0)] if count else []
        return [self.path(step) for step in steps]
