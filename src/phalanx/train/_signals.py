"""Turn SIGTERM / SIGINT into a stop request, so a training loop can save a checkpoint and return.

::

    from phalanx.train import StopSignal

    with StopSignal() as stop:                  # SIGTERM and SIGINT no longer kill the process
        for step in range(start, steps):
            train_step(step)
            # every rank must stop at the same step: agree (a signal may reach only some ranks)
            if phalanx.allreduce(int(stop.requested), op="max"):
                manager.save(capture_state(model=model, optimizer=opt, progress=...), step)
                break
    # the previous handlers are back here

A batch scheduler (Slurm, Kubernetes) sends SIGTERM some time before it
kills a job; a user presses Ctrl-C. Inside the ``with`` block either one only
sets ``stop.requested`` (and ``stop.signal_name``), so the loop finishes its
step, writes a checkpoint and returns. A **second** SIGINT restores the
previous SIGINT handler and raises ``KeyboardInterrupt``: pressing Ctrl-C
twice always gets out. ``stop.request()`` makes the same request from code.

A signal the process ignores (``SIG_IGN``, as under ``nohup``) stays ignored.
Python runs signal handlers in the main thread only, so the handlers are
installed only there; entered in another thread, ``StopSignal`` is inert
(it says so once, with a warning): signals keep their usual effect and only
``request()`` sets ``requested``.
"""

from __future__ import annotations

import signal
import threading
import warnings
from collections.abc import Iterable
from types import FrameType, TracebackType
from typing import Any

from .._errors import InvalidArgumentError, UsageError

__all__ = ["StopSignal"]

_warned_off_main_thread = False
_UNCATCHABLE = {getattr(signal, name) for name in ("SIGKILL", "SIGSTOP") if hasattr(signal, name)}


def _signal(item: Any) -> signal.Signals | None:
    """The signal a number or a name (``"SIGTERM"``, ``"term"``) stands for here, or None."""
    try:
        if isinstance(item, str):
            name = item.upper()
            return signal.Signals[name if name.startswith("SIG") else "SIG" + name]
        if isinstance(item, int) and not isinstance(item, bool):
            return signal.Signals(item)
    except (KeyError, ValueError):
        pass
    return None


def _parse(signals: Any) -> tuple[signal.Signals, ...]:
    if isinstance(signals, (str, int)):
        signals = (signals,)
    try:
        items = list(signals)
    except TypeError:
        raise InvalidArgumentError(
            f"phalanx.train.StopSignal(signals={signals!r}): pass signal numbers or names, e.g. "
            "(signal.SIGTERM, 'SIGUSR1')."
        ) from None
    parsed: list[signal.Signals] = []
    for item in items:
        sig = _signal(item)
        if sig is None:
            raise InvalidArgumentError(
                f"phalanx.train.StopSignal(signals=...): {item!r} is not a signal of this platform; use "
                "e.g. signal.SIGTERM, 'SIGINT' or 'SIGUSR1'."
            )
        if sig in _UNCATCHABLE:
            raise InvalidArgumentError(
                f"phalanx.train.StopSignal(signals=...): {sig.name} cannot be caught by any process; "
                "use SIGTERM, SIGINT, SIGUSR1, ..."
            )
        if sig not in parsed:
            parsed.append(sig)
    if not parsed:
        raise InvalidArgumentError("phalanx.train.StopSignal(signals=()): give at least one signal.")
    return tuple(parsed)


class StopSignal:
    """A context manager that turns SIGTERM/SIGINT (or ``signals``) into a stop request a loop can poll.

    ::

        with StopSignal() as stop:          # the signals no longer kill the process
            for step in range(steps):
                train_step(step)
                if phalanx.allreduce(int(stop.requested), op="max"):   # every rank stops alike
                    save_checkpoint(...)
                    break

    Inside the block a signal only sets ``requested``; a **second** SIGINT
    restores the previous handler and raises ``KeyboardInterrupt``. Ignored
    signals stay ignored; outside the main thread it is inert (with a warning)
    and only :meth:`request` sets ``requested``. ``signals``: numbers, names
    (``"SIGUSR1"``) or ``signal.Signals``.

    ``requested``: whether a stop was requested; ``signal_name``: what
    requested it first (``"SIGTERM"``, ``"SIGINT"``, or the name given to
    :meth:`request`), ``None`` before. ``count``: requests so far.
    """

    def __init__(self, signals: Iterable[int | str | signal.Signals] | int | str = (signal.SIGTERM,
                                                                                     signal.SIGINT)) -> None:
        self.signals = _parse(signals)
        self._previous: dict[signal.Signals, Any] = {}
        self._installed: set[signal.Signals] = set()
        self._requested = False
        self._name: str | None = None
        self._count = 0
        self._sigints = 0
        self._active = False
        self.inert = False

    # -- state ----------------------------------------------------------------------------------
    @property
    def requested(self) -> bool:
        """True once a signal (or :meth:`request`) asked the loop to stop."""
        return self._requested

    @property
    def signal_name(self) -> str | None:
        """The name of what requested the stop first, or ``None``."""
        return self._name

    @property
    def count(self) -> int:
        """How many requests arrived (signals and :meth:`request` calls)."""
        return self._count

    def request(self, name: str = "manual") -> None:
        """Request a stop from code, as if a signal called ``name`` had arrived."""
        self._count += 1
        if not self._requested:
            self._requested = True
            self._name = str(name)

    # -- the handlers -----------------------------------------------------------------------------
    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if sig == signal.SIGINT:
            self._sigints += 1
            if self._sigints > 1:  # Ctrl-C twice: get out
                self._restore(signal.SIGINT)
                raise KeyboardInterrupt
        self.request(sig.name)

    def _restore(self, sig: signal.Signals) -> None:
        previous = self._previous.pop(sig, None)
        if sig not in self._installed:
            return
        self._installed.discard(sig)
        signal.signal(sig, signal.SIG_DFL if previous is None else previous)

    def __enter__(self) -> StopSignal:
        global _warned_off_main_thread
        if self._active:
            raise UsageError("phalanx.train.StopSignal: this StopSignal is already active; use a new one "
                             "to nest.")
        self._active = True
        self._installed = set()
        self._sigints = 0
        if threading.current_thread() is not threading.main_thread():
            self.inert = True
            if not _warned_off_main_thread:
                _warned_off_main_thread = True
                warnings.warn(
                    "phalanx.train.StopSignal was entered outside the main thread, where signal handlers "
                    "cannot be installed: it is inert (SIGTERM/SIGINT keep their usual effect; only "
                    "stop.request() sets stop.requested).", RuntimeWarning, stacklevel=2)
            return self
        self.inert = False
        try:
            for sig in self.signals:
                previous = signal.getsignal(sig)
                if previous == signal.SIG_IGN:  # ignored on purpose (nohup, a background job): stays so
                    continue
                self._previous[sig] = previous
                signal.signal(sig, self._handle)
                self._installed.add(sig)
        except BaseException:
            for sig in list(self._installed):
                self._restore(sig)
            self._active = False
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for sig in list(self._installed):
            self._restore(sig)
        self._previous.clear()
        self._active = False

    def __repr__(self) -> str:
        names = ", ".join(s.name for s in self.signals)
        return (f"StopSignal([{names}], requested={self._requested}, signal_name={self._name!r}"
                f"{', inert' if self.inert else ''})")
