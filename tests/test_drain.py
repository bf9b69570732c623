"""``phalanx._drain.await_readers``: a failing rank's last output is read before its job is torn down.

Real pipes and a real reader process: the wait ends as soon as the reader has taken
every byte, is bounded when nobody reads, and does not wait for a regular file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from phalanx._drain import also_wait_for, await_readers

READER = "import sys, time; time.sleep(float(sys.argv[1])); sys.stdin.buffer.read()"


def test_waits_until_a_slow_reader_took_the_bytes_and_is_bounded_without_reader_and_ignores_files(
        tmp_path: Path) -> None:
    # A reader that starts reading after 0.5 s: the wait ends then, with the pipe empty.
    r, w = os.pipe()
    reader = subprocess.Popen([sys.executable, "-c", READER, "0.5"], stdin=r)
    os.close(r)
    os.write(w, b"x" * 1000)
    start = time.monotonic()
    await_readers([w], limit=30)
    waited = time.monotonic() - start
    os.close(w)
    assert reader.wait(timeout=30) == 0
    assert 0.2 < waited < 20, waited

    # Nobody reads: bounded by the limit.
    r, w = os.pipe()
    os.write(w, b"y" * 100)
    start = time.monotonic()
    await_readers([w], limit=0.3)
    assert 0.25 < time.monotonic() - start < 10
    os.close(r)
    os.close(w)

    # A descriptor named by also_wait_for (the job channel) is waited for by default.
    r, w = os.pipe()
    os.write(w, b"c" * 100)
    also_wait_for(w)
    start = time.monotonic()
    await_readers(limit=0.3)
    assert 0.25 < time.monotonic() - start < 10
    os.read(r, 100)
    start = time.monotonic()
    await_readers(limit=5)
    assert time.monotonic() - start < 1
    os.close(r)

    # A regular file (a --log-dir log) and a closed descriptor: nothing to wait for.
    fd = os.open(tmp_path / "log", os.O_WRONLY | os.O_CREAT)
    os.write(fd, b"z" * 100)
    start = time.monotonic()
    await_readers([fd, 987], limit=5)
    assert time.monotonic() - start < 1
    os.close(fd)
