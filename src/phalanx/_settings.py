"""Settings read from the environment before anything heavy is imported.

Like ``mpi4py.rc``: a tiny object whose fields can be changed in code before
:func:`phalanx.init`, with defaults taken from ``PHALANX_*`` variables.

=========================  =======================  ======================================
variable                   field                    meaning
=========================  =======================  ======================================
``PHALANX_TIMEOUT``        ``timeout``              seconds a blocking collective may wait
``PHALANX_CHECK``          ``check``                ``0`` turns off the per-call buffer check
``PHALANX_DEBUG``          ``debug``                ``1`` also fingerprints the call site
``PHALANX_GPU_AWARE_MPI``  ``gpu_aware_mpi``        ``0``/``1`` overrides detection
``PHALANX_ALLOW_PICKLE``   ``allow_pickle``         ``1`` enables object collectives
``PHALANX_HIERARCHICAL``   ``hierarchical``         ``0``/``1`` allreduce within hosts, then across
``PHALANX_MPI_RING``       ``mpi_ring``             ``0``/``1`` mpi's ring allreduce (large buffers)
=========================  =======================  ======================================

A value that is not a valid number or flag raises :class:`InvalidSettingError`
naming the variable (a typo never silently means "on" or "off").
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from ._errors import InvalidSettingError, PhalanxError

__all__ = ["Settings", "env_flag", "env_seconds", "settings"]

DEFAULT_TIMEOUT = 300.0
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_flag(name: str, default: bool | None) -> bool | None:
    """The flag in environment variable ``name`` (1/0, true/false, yes/no, on/off), else ``default``."""
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    word = value.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    if word == "auto" and default is None:  # the flags whose default is detection
        return None
    raise InvalidSettingError(f"{name}={value!r} is not a flag: set {name}=1 (on) or {name}=0 (off), "
                              "or unset it for the default.")


def env_seconds(name: str, default: float, *, zero_ok: bool = False, call: str = "",
                error: type[PhalanxError] = InvalidSettingError) -> float:
    """The number of seconds in environment variable ``name``, else ``default`` (unset or empty).

    A value that is not a finite number above 0 (0 or more with ``zero_ok``) raises ``error``
    (:class:`InvalidSettingError`, or e.g. the launcher's :class:`LaunchError`), its message
    starting with ``call`` (e.g. ``"phalanx run: "``) and naming the variable, the value and an example.
    """
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not zero_ok):
        least = "0 or more" if zero_ok else "more than 0"
        raise error(f"{call}{name}={value!r} is not a number of seconds (finite, {least}); set it to e.g. "
                    f"{name}={default:g} (the default), or unset it.")
    return seconds


@dataclass
class Settings:
    """phalanx's settings: each field's default comes from its ``PHALANX_*`` variable.

    Fields: ``timeout`` (seconds a blocking collective may wait, ``PHALANX_TIMEOUT``,
    default 300), ``check`` (agree on every collective's buffer across ranks,
    ``PHALANX_CHECK``, default on), ``debug`` (also fingerprint the call site,
    ``PHALANX_DEBUG``), ``gpu_aware_mpi`` (pass CUDA memory to MPI directly;
    ``None`` asks the MPI library, ``PHALANX_GPU_AWARE_MPI``), ``allow_pickle``
    (enable the object collectives, ``PHALANX_ALLOW_PICKLE``), ``hierarchical``
    (allreduce within hosts, then across them; ``None``: off for gloo, on for mpi's
    ring where the world spans hosts and a host holds several ranks;
    ``PHALANX_HIERARCHICAL``), ``mpi_ring`` (mpi's own ring allreduce for
    buffers of 1 MiB and more; ``None`` = on when the world spans hosts, ``PHALANX_MPI_RING``). Change a field in
    code before :func:`phalanx.init` to override the environment.
    """

    timeout: float = field(default_factory=lambda: env_seconds("PHALANX_TIMEOUT", DEFAULT_TIMEOUT))
    check: bool = field(default_factory=lambda: bool(env_flag("PHALANX_CHECK", True)))
    debug: bool = field(default_factory=lambda: bool(env_flag("PHALANX_DEBUG", False)))
    gpu_aware_mpi: bool | None = field(default_factory=lambda: env_flag("PHALANX_GPU_AWARE_MPI", None))
    allow_pickle: bool = field(default_factory=lambda: bool(env_flag("PHALANX_ALLOW_PICKLE", False)))
    hierarchical: bool | None = field(default_factory=lambda: env_flag("PHALANX_HIERARCHICAL", None))
    mpi_ring: bool | None = field(default_factory=lambda: env_flag("PHALANX_MPI_RING", None))


settings = Settings()
