"""Horovod's top-level API on phalanx: ``phalanx.horovod.run`` (and ``phalanx.horovod.torch``).

::

    import phalanx.horovod as horovod
    import phalanx.horovod.torch as hvd

    def train(lr):
        hvd.init()
        ...
        return hvd.rank()

    horovod.run(train, args=(0.1,), num_proc=2)          # [0, 1]
    horovod.run(train, kwargs={"lr": 0.1}, num_proc=4, hosts="h0:2,h1:2", use_gloo=True)
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from .._errors import InvalidArgumentError, UnsupportedArgumentError

__all__ = ["__version__", "run"]

__version__ = "0.28.1"  # the Horovod release whose API this follows (phalanx's own: phalanx.__version__)

_ELASTIC = ("phalanx does not resize a running job; it restarts a failed one (`phalanx run --max-restarts K "
            "--min-ranks M` for scripts). Drop the argument to run on a fixed number of ranks")


def run(func: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
        num_proc: int = 1, min_num_proc: int | None = None, max_num_proc: int | None = None,
        slots: int | None = None, reset_limit: int | None = None, cooldown_range: Any = None,
        hosts: str | None = None, hostfile: str | None = None, start_timeout: float | None = None,
        ssh_port: int | None = None, ssh_identity_file: str | None = None, disable_cache: bool | None = None,
        output_filename: str | None = None, verbose: bool | None = None, use_gloo: bool | None = None,
        use_mpi: bool | None = None, mpi_args: str | None = None, network_interface: str | None = None,
        executable: str | None = None, np: int | None = None, min_np: int | None = None,
        max_np: int | None = None) -> list[Any]:
    """Run ``func(*args, **kwargs)`` on ``num_proc`` ranks and return their return values in rank order.

    Horovod's ``horovod.run``: the ranks are started as ``phalanx run`` starts a
    script (mpiexec for mpi, spawned and supervised processes for gloo; on other
    hosts through ssh), so the first failure stops every rank. ``func`` calls
    ``hvd.init()`` itself; it travels by cloudpickle when installed (lambdas and
    closures too), else by reference to a module-level function of a file.

    What runs:
        func, args, kwargs: the function and its arguments (picklable); its return
            value on each rank must be picklable.
        num_proc: the number of ranks (``np``: its deprecated name, as in Horovod).
        use_gloo, use_mpi: the backend (default: mpi where mpi4py and mpiexec are
            installed, else gloo); not both.
        executable: the Python of the ranks; only this process's own (``sys.executable``).

    Where:
        hosts: ``"h0:2,h1:2"`` (host:slots), or hostfile: a file of ``host slots=N`` lines;
            not both. Default: every rank here. With hosts on other machines the
            working directory must be shared by every host (the call travels
            through it). ssh_port, ssh_identity_file: ssh's ``-p``/``-i``.
        network_interface: the one interface the ranks use across hosts (``eth0``).
        mpi_args: extra mpiexec arguments, one string.

    Supervision and output:
        start_timeout: seconds every rank has to reach ``hvd.init`` once another has.
        output_filename: a directory for each rank's output (``rank.<r>.log``).
        verbose: say how the job is started. disable_cache: accepted, ignored.

    Elastic (min_num_proc, max_num_proc, slots, reset_limit, cooldown_range, min_np,
    max_np): not supported; phalanx restarts failed jobs instead of resizing them.

    Returns ``[result of rank 0, result of rank 1, ...]``. Raises JobFailedError (a
    RuntimeError, as Horovod's) naming the first rank that raised, with its
    traceback; InvalidArgumentError for bad or conflicting arguments;
    UnsupportedArgumentError for the elastic arguments and another executable;
    LaunchError when the job cannot start (no mpiexec, unknown hosts, ...).
    """
    from ..launch import launch
    from ..launch._horovodrun import describe_job
    from ..launch._options import job_from_args, run_parser
    from . import _runner

    num_proc = _deprecated_np(num_proc, np)
    _check(func, num_proc, locals())
    argv = _argv(num_proc, hosts=hosts, hostfile=hostfile, start_timeout=start_timeout, ssh_port=ssh_port,
                 ssh_identity_file=ssh_identity_file, output_filename=output_filename, verbose=verbose,
                 use_gloo=use_gloo, use_mpi=use_mpi, mpi_args=mpi_args, network_interface=network_interface)
    job = job_from_args(run_parser().parse_args(argv), ["-m", "phalanx.horovod._runner"])
    call_dir = _runner.call_dir_for(remote=_has_remote(job.hosts))
    try:
        _runner.write_call(call_dir, func, args, dict(kwargs or {}))
        job.target = ["-m", "phalanx.horovod._runner", call_dir]
        if verbose:
            describe_job(job)
        code = launch(job)
        return _runner.collect(call_dir, job.n, code, f"phalanx.horovod.run({getattr(func, '__name__', func)})")
    finally:
        _runner.remove(call_dir)


def _deprecated_np(num_proc: int, np: int | None) -> int:
    if np is None:
        return num_proc
    warnings.warn("phalanx.horovod.run: np is deprecated, use num_proc instead (as in Horovod)",
                  DeprecationWarning, stacklevel=3)
    return np if num_proc == 1 else num_proc


def _check(func: Any, num_proc: Any, given: dict[str, Any]) -> None:
    if not callable(func):
        raise InvalidArgumentError(f"phalanx.horovod.run(func={func!r}): give the function to run on every rank.")
    if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
        raise InvalidArgumentError(f"phalanx.horovod.run(num_proc={num_proc!r}): give the number of ranks, a "
                                   "whole number of 1 or more, e.g. num_proc=2.")
    for name in ("min_num_proc", "max_num_proc", "slots", "reset_limit", "cooldown_range", "min_np", "max_np"):
        if given[name] is not None:
            raise UnsupportedArgumentError(f"phalanx.horovod.run({name}={given[name]!r}): elastic runs are not "
                                           f"supported: {_ELASTIC}.")
    if given["hosts"] is not None and given["hostfile"] is not None:
        raise InvalidArgumentError(f"phalanx.horovod.run(hosts={given['hosts']!r}, hostfile={given['hostfile']!r}): "
                                   "give one of them (as Horovod requires).")
    if given["use_gloo"] and given["use_mpi"]:
        raise InvalidArgumentError("phalanx.horovod.run(use_gloo=True, use_mpi=True): choose one backend.")
    timeout = given["start_timeout"]
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not 0 < timeout < math.inf):
        raise InvalidArgumentError(f"phalanx.horovod.run(start_timeout={timeout!r}): give a positive number of "
                                   "seconds, e.g. start_timeout=60.")
    port = given["ssh_port"]
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
        raise InvalidArgumentError(f"phalanx.horovod.run(ssh_port={port!r}): give ssh's port number, e.g. 22.")
    executable = given["executable"]
    if executable is not None and os.path.realpath(executable) != os.path.realpath(sys.executable):
        raise UnsupportedArgumentError(
            f"phalanx.horovod.run(executable={executable!r}): phalanx starts every rank with this process's "
            f"Python ({sys.executable}); run the driver with that interpreter instead, or leave executable unset.")


def _argv(num_proc: int, **options: Any) -> list[str]:
    """``phalanx run``'s flags for these options (so both take the same path to a job)."""
    argv = ["-np", str(num_proc)]
    flags = {"hosts": "-H", "hostfile": "--hostfile", "start_timeout": "--start-timeout", "ssh_port": "-p",
             "ssh_identity_file": "-i", "output_filename": "--output-filename", "mpi_args": "--mpi-args"}
    for name, flag in flags.items():
        value = options[name]
        if value is not None:
            argv.append(f"{flag}={os.fspath(value) if isinstance(value, os.PathLike) else value}")
    for name, flag in (("verbose", "--verbose"), ("use_gloo", "--gloo"), ("use_mpi", "--mpi")):
        if options[name]:
            argv.append(flag)
    for nic in str(options["network_interface"] or "").split(","):
        if nic.strip():
            argv.append(f"--network-interface={nic.strip()}")
    return argv


def _has_remote(hosts: Any) -> bool:
    from .._net import is_local_address

    return bool(hosts) and any(not is_local_address(h.name) for h in hosts)
