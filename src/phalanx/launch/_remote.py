"""The per-host launcher of a ``phalanx run --hosts`` job: ``python -m phalanx.launch._remote``.

The driver (:mod:`._from_one_host`) starts one on every host, through ssh or ``--rsh``,
and talks to it over its stdin and stderr only, so that nothing secret is ever on
a command line (which every user of the host can read with ``ps``):

* stdin, line 1 (JSON): the job (``Launch`` fields), this host's global ranks, the
  world size, ``nnodes``/``node_rank``, the job's secret, the environment to add,
  and the master (``HOST:PORT``; ``null`` on node 0 when it is to choose one,
  ``"wait"`` on the others until line 2 brings it);
* later lines: ``{"master": "HOST:PORT"}``, or ``{"stop": SIGNUM}`` (the driver got a
  Ctrl-C or SIGTERM: treated as that signal, a second one hurries); in a job that re-forms
  in place (line 1 has ``elastic``), ``{"in_place": true}`` and ``{"kill": MEMBER}`` for its
  :class:`._epochs_hosts.Relay`;
* **EOF on stdin**: the driver died or its connection closed: every rank here is
  stopped at once. This is how no process outlives a job on a remote host;
* on stderr, besides the ranks' output and this launcher's report, lines starting
  with ``@phalanx-remote`` carry JSON for the driver: node 0's chosen master, that
  the ranks are starting, and every launcher's outcome (the first failing rank, its
  exception, when).

Exit status: as ``phalanx run`` on one host; 1 when the driver went away.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
from dataclasses import asdict
from typing import Any

from .._errors import LaunchError
from .._net import describe_interfaces, interface_address, is_loopback, resolve, route_source
from ._epochs_hosts import Relay
from ._job import Launch, Signals, rank_env
from ._on_each_host import MARK, parse_master, rank_placement
from ._spawn import Outcome, free_port, run_spawn

__all__ = ["main"]

LOST = "the driver closed its connection to this host (another host failed, or the driver or its connection is gone)"


class _Stdin:
    """Reads the driver's lines; records EOF (``lost``) and turns ``stop`` lines into signals here."""

    def __init__(self) -> None:
        self.stream = sys.stdin.buffer
        self.closed = threading.Event()
        self.listener: Any = None  # a Relay (epochs across hosts): it hears the driver's other lines

    def line(self) -> dict[str, Any] | None:
        """The next JSON line; None at EOF."""
        raw = self.stream.readline()
        if not raw:
            self.closed.set()
            return None
        return json.loads(raw)

    def follow(self) -> None:
        """Watch stdin in the background for the rest of the job."""
        threading.Thread(target=self._run, daemon=True, name="phalanx-stdin").start()

    def _run(self) -> None:
        try:
            while (message := self.line()) is not None:
                if "stop" in message:
                    os.kill(os.getpid(), int(message["stop"]))  # handled by Signals, like a local Ctrl-C
                elif self.listener is not None:
                    self.listener.receive(message)
        except (ValueError, TypeError, OSError):  # a garbled line: the driver cannot be trusted to be there
            self.closed.set()

    def lost(self) -> str | None:
        return LOST if self.closed.is_set() else None


def tell(**message: Any) -> None:
    """One line for the driver on stderr (it never shows it to the user)."""
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(MARK + json.dumps(message) + "\n")
        sys.stderr.flush()


def choose_master(config: dict[str, Any], iface: str | None) -> tuple[str, int]:
    """Node 0's address for the rendezvous (on ``iface``, else the one that routes to the next host,
    else its own name's) and a port free on it."""
    address = interface_address(iface) if iface else None
    if iface and not address:
        raise LaunchError(f"phalanx run --iface {iface}: host {config['host']} has no interface {iface!r} with "
                          "an address; give the name of an interface every host has (see `ip addr`).")
    peer = config.get("peer")
    if address is None and peer:
        with contextlib.suppress(OSError):
            source = route_source(peer, 9)
            address = None if is_loopback(source) else source
    if address is None:
        try:
            address = resolve(config["host"])
        except OSError:
            address = socket.gethostname()
    if config.get("nnodes", 1) > 1 and is_loopback(address):
        raise LaunchError(
            f"phalanx run --hosts: the rendezvous address on host {config['host']} is {address}, a loopback "
            f"address the other hosts cannot reach (from {'--iface ' + iface if iface else 'its host name'}). "
            f"Choose the interface the hosts share with --iface NAME (or PHALANX_IFACE). Interfaces here: "
            f"{describe_interfaces()}.")
    with contextlib.suppress(OSError):
        return address, free_port(address)
    return address, free_port("0.0.0.0")


def serve(config: dict[str, Any], stdin: _Stdin) -> int:
    """Run this host's ranks of the job ``config`` describes; its exit status."""
    os.environ.update(config.get("env", {}))  # what the driver forwards (ssh passes no environment)
    job = Launch(**config["job"])
    job.resolve_settings()
    iface = job.iface or os.environ.get("PHALANX_IFACE") or None
    master_text = config.get("master")
    if master_text is None:
        master = choose_master(config, iface)
        tell(master=f"{master[0]}:{master[1]}" if ":" not in master[0] else f"[{master[0]}]:{master[1]}")
    else:
        if master_text == "wait":
            message = stdin.line()
            if message is None:  # the driver went away before the job started
                tell(outcome=asdict(Outcome(stopped=LOST)), code=1)
                return 1
            master_text = message["master"]
        master = parse_master(master_text)
    job_dir = tempfile.mkdtemp(prefix="phalanx-job-")
    relay = Relay(config["elastic"], job_dir, tell) if config.get("elastic") else None
    stdin.listener = relay
    stdin.follow()
    tell(started=True)
    placement = rank_placement(job, config["ranks"], config["world_size"], master, config["secret"],
                               config["nnodes"], config["node_rank"])
    env = rank_env(job, job_dir)
    outcome = Outcome()
    try:
        with Signals(job.stop_grace or 0.0) as signals:
            code = run_spawn(job, env, job_dir, signals, placement, lost=stdin.lost, outcome=outcome, epochs=relay)
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)
    tell(outcome=asdict(outcome), code=code)
    return code


class _Quiet:
    """stderr that never raises: the driver's end of the pipe may be gone."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        with contextlib.suppress(OSError, ValueError):
            return int(self.stream.write(text))
        return 0

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def main() -> int:
    """Read the job from stdin and run this host's ranks (the driver's side: :mod:`._from_one_host`)."""
    sys.stderr = _Quiet(sys.stderr)
    stdin = _Stdin()
    try:
        config = stdin.line()
        if config is None:
            return 1
        return serve(config, stdin)
    except LaunchError as exc:  # the driver prints it, naming this host
        tell(outcome=asdict(Outcome(message=str(exc))), code=2)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    code = main()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)  # never wait for the stdin thread, nor for a stderr the driver stopped reading
