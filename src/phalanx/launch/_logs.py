"""``--log-dir``: each rank's output in ``DIR/rank.<r>.log``, echoed to the console as ``[r] line``.

Spawned ranks write into a pipe that the launcher copies to the file and the
console. MPI ranks cannot be piped one by one (mpiexec merges them), so the
worker bootstrap points its own stdout/stderr at the file and the launcher
follows the files (like ``tail -f``) to echo them.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import IO, Protocol

__all__ = ["Echo", "FileFollower", "log_path", "pump"]

_console_lock = threading.Lock()


def log_path(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, f"rank.{rank}.log")


class Echo:
    """Writes complete lines to the console with a ``[rank] `` prefix (or drops them when quiet)."""

    def __init__(self, rank: int, enabled: bool = True) -> None:
        self.prefix = f"[{rank}] ".encode()
        self.enabled = enabled
        self.partial = b""

    def feed(self, data: bytes) -> None:
        if not self.enabled:
            return
        *lines, self.partial = (self.partial + data).split(b"\n")
        if lines:
            self._write(b"".join(self.prefix + line + b"\n" for line in lines))

    def close(self) -> None:
        if self.enabled and self.partial:
            self._write(self.prefix + self.partial + b"\n")
        self.partial = b""

    def _write(self, data: bytes) -> None:
        with _console_lock:
            try:
                sys.stdout.buffer.write(data)
                sys.stdout.buffer.flush()
            except (OSError, ValueError):
                pass  # a closed console must not kill the launcher


class Sink(Protocol):
    """Where :func:`pump` copies bytes: a binary file, a console, or a record reader."""

    def write(self, data: bytes, /) -> object: ...

    def flush(self) -> None: ...


def pump(source: IO[bytes], sinks: list[Sink], echo: Echo | None = None,
         tail: bytearray | None = None, tail_max: int = 1 << 16) -> threading.Thread:
    """A daemon thread copying ``source`` to every sink (and ``echo``; the last bytes into ``tail``)."""

    def run() -> None:
        fd = source.fileno()
        while True:
            try:
                data = os.read(fd, 1 << 16)
            except OSError:
                break
            if not data:
                break
            for sink in sinks:
                try:
                    sink.write(data)
                    sink.flush()
                except (OSError, ValueError):
                    pass
            if echo is not None:
                echo.feed(data)
            if tail is not None:
                tail.extend(data)
                del tail[:-tail_max]
        if echo is not None:
            echo.close()

    thread = threading.Thread(target=run, daemon=True, name="phalanx-pump")
    thread.start()
    return thread


class FileFollower:
    """Follows ``DIR/rank.<r>.log`` for every rank and echoes what is appended."""

    def __init__(self, log_dir: str, n: int, echo: bool) -> None:
        self.paths = [log_path(log_dir, r) for r in range(n)]
        self.echoes = [Echo(r, echo) for r in range(n)]
        self.offsets = [0] * n
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="phalanx-follow")

    def start(self) -> FileFollower:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()
        self._poll()  # whatever came after the last poll
        for echo in self.echoes:
            echo.close()

    def _run(self) -> None:
        while not self.stopped.wait(0.1):
            self._poll()

    def _poll(self) -> None:
        for r, path in enumerate(self.paths):
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets[r])
                    data = f.read()
            except OSError:
                continue
            if data:
                self.offsets[r] += len(data)
                self.echoes[r].feed(data)
