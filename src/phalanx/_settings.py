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
=========================  =======================  ======================================
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

__all__ = ["Settings", "settings"]

DEFAULT_TIMEOUT = 300.0


def _env_flag(name: str, default: bool | None) -> bool | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number of seconds, e.g. {name}=60") from None
    if seconds <= 0:
        raise ValueError(f"{name}={value!r} must be a positive number of seconds")
    return seconds


@dataclass
class Settings:
    timeout: float = field(default_factory=lambda: _env_float("PHALANX_TIMEOUT", DEFAULT_TIMEOUT))
    check: bool = field(default_factory=lambda: bool(_env_flag("PHALANX_CHECK", True)))
    debug: bool = field(default_factory=lambda: bool(_env_flag("PHALANX_DEBUG", False)))
    gpu_aware_mpi: bool | None = field(default_factory=lambda: _env_flag("PHALANX_GPU_AWARE_MPI", None))
    allow_pickle: bool = field(default_factory=lambda: bool(_env_flag("PHALANX_ALLOW_PICKLE", False)))


settings = Settings()
