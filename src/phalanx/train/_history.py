"""What :func:`phalanx.train.fit` returns: every logged metric, by step.

::

    history = fit(...)
    history["val/top1"]          # [0.41, 0.66, 0.83]: the values, in step order
    history.steps("val/top1")    # [50, 100, 150]: the steps they were measured at
    history.last("train/loss")   # the latest value
    history.summary              # totals: steps, samples, time, samples/s, best val metrics, ...
    history.records              # the raw records: [{"step": 50, "epoch": 0, "train/loss": ...}, ...]

The same on every rank: metrics are reduced across ranks before they are recorded.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

from .._errors import UnknownMetricError

__all__ = ["History"]


class History:
    """The metrics :func:`fit` recorded, by step, the same on every rank; also its summary.

    ::

        history["val/top1"]          # the values, in step order
        history.steps("val/top1")    # the steps they were measured at
        history.last("train/loss")   # the latest value; history.best("val/top1") the largest

    Attributes: ``records`` (``[{"step": 50, "epoch": 0.5, "train/loss": ...}, ...]``),
    ``summary`` (steps, samples, time, samples/s, skipped steps, last and best metrics, ...)
    ``stopped`` (the signal that stopped the run, or ``None``) and ``recoveries`` (with
    ``elastic=True``: each re-formation this process took part in, ``{"epoch", "size", "lost",
    "joined", "step", "seconds", "cause"}``, the step being the one done again). ``to_json()`` and
    ``History.from_json(text)`` round-trip it.
    """

    def __init__(self, records: list[dict[str, Any]] | None = None) -> None:
        self.records: list[dict[str, Any]] = list(records or [])
        self.summary: dict[str, Any] = {}
        self.stopped: str | None = None  # e.g. "SIGTERM" when a signal ended the run early
        self.recoveries: list[dict[str, Any]] = []  # fit(elastic=True): each re-formation on this process

    def append(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def keys(self) -> list[str]:
        """Every metric name recorded, in first-seen order."""
        seen: dict[str, None] = {}
        for record in self.records:
            for key in record:
                if key not in ("step", "epoch"):
                    seen.setdefault(key)
        return list(seen)

    def __getitem__(self, key: str) -> list[Any]:
        if key not in self.keys():
            raise UnknownMetricError(f"history[{key!r}]: no metric of that name was recorded; it has "
                                     f"{', '.join(self.keys()) or 'none'}. Check the name (e.g. 'val/top1').")
        return [r[key] for r in self.records if key in r]

    def __contains__(self, key: object) -> bool:
        return key in self.keys()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def steps(self, key: str) -> list[int]:
        """The steps at which ``key`` was recorded."""
        return [r["step"] for r in self.records if key in r]

    def last(self, key: str, default: Any = None) -> Any:
        """The most recent value of ``key`` (``default`` when never recorded)."""
        for record in reversed(self.records):
            if key in record:
                return record[key]
        return default

    def best(self, key: str, mode: str = "max") -> Any:
        """The best value of ``key`` (``mode="max"`` for accuracies, ``"min"`` for losses)."""
        values = [v for v in self[key] if isinstance(v, (int, float)) and math.isfinite(v)]
        if not values:
            return None
        return max(values) if mode == "max" else min(values)

    def to_json(self) -> str:
        return json.dumps({"records": self.records, "summary": self.summary, "stopped": self.stopped},
                          allow_nan=True)

    @classmethod
    def from_json(cls, text: str) -> History:
        data = json.loads(text)
        history = cls(data.get("records", []))
        history.summary = dict(data.get("summary", {}))
        history.stopped = data.get("stopped")
        return history

    def __repr__(self) -> str:
        return f"History({len(self.records)} records, metrics {self.keys()}, stopped={self.stopped!r})"
