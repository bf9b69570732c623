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

from ._errors import InvalidSettingError

__all__ = ["Settings", "env_flag", "env_float", "settings"]

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


def env_float(name: str, default: float, *, minimum: float = 0.0, inclusive: bool = False) -> float:
    """The number of seconds in environment variable ``name`` (above ``minimum``), else ``default``."""
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise InvalidSettingError(f"{name}={value!r} is not a number of seconds: set e.g. {name}=60, "
                                  "or unset it for the default.") from None
    if not math.isfinite(seconds) or seconds < minimum or (seconds == minimum and not inclusive):
        bound = f"at least {minimum:g}" if inclusive else f"more than {minimum:g}"
        raise InvalidSettingError(f"{name}={value!r}: the number of seconds must be finite and {bound}, e.g. "
                                  f"{name}=60, or unset it for the default.")
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

    timeout: float = field(default_factory=lambda: env_float("PHALANX_TIMEOUT", DEFAULT_TIMEOUT))
    check: bool = field(default_factory=lambda: bool(env_flag("PHALANX_CHECK", True)))
    debug: bool = field(default_factory=lambda: bool(env_flag("PHALANX_DEBUG", False)))
    gpu_aware_mpi: bool | None = field(default_factory=lambda: env_flag("PHALANX_GPU_AWARE_MPI", None))
    allow_pickle: bool = field(default_factory=lambda: bool(env_flag("PHALANX_ALLOW_PICKLE", False)))
    hierarchical: bool | None = field(default_factory=lambda: env_flag("PHALANX_HIERARCHICAL", None))
    mpi_ring: bool | None = field(default_factory=lambda: env_flag("PHALANX_MPI_RING", None))


settings = Settings()
