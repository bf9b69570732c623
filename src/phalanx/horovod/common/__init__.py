"""Horovod's ``horovod.common`` on phalanx: the exception names Horovod scripts catch
(:mod:`phalanx.horovod.common.exceptions`)."""

from __future__ import annotations

from . import exceptions

__all__ = ["exceptions"]
