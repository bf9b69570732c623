"""MPI jobs: find ``mpiexec``, adapt to its implementation, run it, explain how it ended.

MPICH's Hydra and Open MPI's mpiexec differ in what a laptop user trips over:

* Open MPI refuses to run as root (containers, CI) unless
  ``OMPI_ALLOW_RUN_AS_ROOT=1`` and ``OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1`` are set,
  and refuses more ranks than cores unless told to oversubscribe; it forwards
  to remote nodes only the variables named with ``-x``.
* Hydra (MPICH, Intel MPI) runs as root, oversubscribes and forwards the whole
  environment by default.

Neither tells the launcher which rank died by a signal except in its own
message ("BAD TERMINATION ... PID 123" / "process rank 1 with PID 123 ...
exited on signal 9"), so mpiexec's output passes through the launcher, which
keeps its tail and maps the PID back to a rank from the ``pid-rank<r>``
files the workers leave in the job directory.
"""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ._launch import GRACE, Launch, LaunchError, Signals, notice, stop_grace, worker_command
from ._logs import FileFollower, log_path, pump
from ._procs import child_setup, descendants, kill_pids
from ._report import ECHOES, Death, any_record, failure_report, first_failure, read_records

__all__ = ["Flavor", "find_mpiexec", "library_version", "mpiexec_flavor", "run_mpi"]

ABORT_GRACE = 5.0  # after a rank recorded an exception, how long mpiexec may take to end the job itself
_HOST = socket.gethostname()
INSTALL_HINT = ("install one with `pip install 'phalanx[mpich]'` (MPICH from PyPI), or load your "
                "cluster's MPI module (`module load openmpi`), or pass --mpiexec PATH")


def find_mpiexec(explicit: str | None = None) -> str | None:
    """``explicit`` (a path or a name on PATH), else the mpiexec beside ``sys.executable``
    (a virtual environment's, from ``pip install mpich``), else ``mpiexec``/``mpirun`` on PATH."""
    if explicit:
        path = explicit if os.sep in explicit else shutil.which(explicit)
        return path if path and os.path.isfile(path) and os.access(path, os.X_OK) else None
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("mpiexec") or shutil.which("mpirun")


@dataclass
class Flavor:
    family: str  # "mpich" (Hydra: MPICH, Intel MPI, MVAPICH), "openmpi" or "unknown"
    version: tuple[int, ...]
    banner: str  # first line of `mpiexec --version`


def classify(text: str) -> str:
    if re.search(r"Open MPI|OpenRTE|open-mpi\.org|PRRTE", text):
        return "openmpi"
    if re.search(r"HYDRA|MPICH|Intel\(R\) MPI|MVAPICH", text, re.IGNORECASE):
        return "mpich"
    return "unknown"


def mpiexec_flavor(mpiexec: str) -> Flavor:
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=20)
        text = out.stdout + out.stderr
    except (OSError, subprocess.SubprocessError) as exc:
        return Flavor("unknown", (), f"`{mpiexec} --version` failed: {exc}")
    family = classify(text)
    if family == "openmpi":
        match = re.search(r"(?:Open MPI|OpenRTE|PRRTE)\)?\s*v?(\d+(?:\.\d+)+)", text)
    else:
        match = re.search(r"Version:\s*(\d+(?:\.\d+)+)", text) or re.search(r"(\d+(?:\.\d+)+)", text)
    version = tuple(int(x) for x in match.group(1).split(".")) if match else ()
    banner = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if family == "mpich" and banner.startswith("HYDRA"):  # "HYDRA build details:" says nothing
        banner = f"Hydra {'.'.join(map(str, version))} (MPICH)"
    return Flavor(family, version, banner)


def library_version() -> str:
    """mpi4py's MPI library version string, without initializing MPI (raises if unavailable)."""
    import mpi4py

    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False
    from mpi4py import MPI

    return str(MPI.Get_library_version()).replace("\x00", "")  # Open MPI ends it with a NUL


def _cores() -> int:
    """Physical cores this process may use: Open MPI's default number of slots on this host."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
        cores = set()
        for cpu in cpus:
            topo = f"/sys/devices/system/cpu/cpu{cpu}/topology"
            with open(f"{topo}/physical_package_id") as p, open(f"{topo}/core_id") as c:
                cores.add((p.read().strip(), c.read().strip()))
        return len(cores) or len(cpus)
    except (OSError, AttributeError):
        return os.cpu_count() or 1


def _openmpi_args(job: Launch, flavor: Flavor, env: dict[str, str], ours: list[str]) -> list[str]:
    args: list[str] = []
    if hasattr(os, "geteuid") and os.geteuid() == 0 and "OMPI_ALLOW_RUN_AS_ROOT" not in env:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        notice("running as root, so OMPI_ALLOW_RUN_AS_ROOT=1 and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 are set "
               "(Open MPI's mpiexec refuses root otherwise).")
    user = " ".join(job.mpi_args)
    placed = re.search(r"oversubscribe|--map-by|--host|-H\b|hostfile|machinefile", user, re.IGNORECASE)
    cores = _cores()
    if job.n > cores and not placed:
        args += ["--map-by", ":OVERSUBSCRIBE"] if flavor.version[:1] >= (5,) else ["--oversubscribe"]
        notice(f"{job.n} ranks on {cores} cores: adding `{' '.join(args)}` (Open MPI refuses more ranks "
               "than cores otherwise; expect each rank to run slower).")
    for name in ours:  # Open MPI forwards only named variables to other nodes
        args += ["-x", name]
    return args


def run_mpi(job: Launch, env: dict[str, str], job_dir: str, signals: Signals) -> int:
    mpiexec = find_mpiexec(job.mpiexec)
    if mpiexec is None:
        where = f"--mpiexec {job.mpiexec!r} is not an executable" if job.mpiexec else "no mpiexec was found"
        raise LaunchError(f"phalanx run --backend mpi: {where}; {INSTALL_HINT}.")
    flavor = mpiexec_flavor(mpiexec)
    _check_library(mpiexec, flavor)
    ours = ["PHALANX_BACKEND", "PHALANX_JOB_DIR", "PYTHONUNBUFFERED", "OMP_NUM_THREADS", *job.env]
    if "PHALANX_TIMEOUT" in env:
        ours.append("PHALANX_TIMEOUT")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):  # these would name the wrong rank
        env.pop(name, None)
    if job.log_dir is not None:
        env["PHALANX_LOG_DIR"] = job.log_dir
        ours.append("PHALANX_LOG_DIR")
        for rank in range(job.n):
            open(log_path(job.log_dir, rank), "wb").close()  # workers append; old runs' text must go
    extra = _openmpi_args(job, flavor, env, ours) if flavor.family == "openmpi" else []
    cmd = [mpiexec, "-n", str(job.n), *extra, *job.mpi_args, *worker_command(job.target)]

    start = time.time()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=child_setup(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    tails = (bytearray(), bytearray())
    pumps = [pump(proc.stdout, [sys.stdout.buffer], tail=tails[0]),
             pump(proc.stderr, [sys.stderr.buffer], tail=tails[1])]
    follower = FileFollower(job.log_dir, job.n, job.echo).start() if job.log_dir is not None else None

    watch = _Watch(job_dir)
    forwarded = 0
    terminate_at: float | None = None  # when to SIGTERM mpiexec ourselves
    kill_at: float | None = None  # when to SIGKILL mpiexec and everything below it
    while proc.poll() is None:
        watch.wait(0.05)
        now = time.monotonic()
        if signals.count > forwarded:
            forwarded = signals.count
            sig = signals.received or 15
            if forwarded > 1:
                kill_at = now  # a second Ctrl-C: no more waiting
            elif _signal_local_ranks(job_dir, job.n, sig):
                # Every rank runs here and got the signal itself: mpiexec is left alone, because Open MPI's
                # kills the ranks a second after forwarding one, too soon for a checkpoint.
                terminate_at = now + stop_grace()
            else:  # ranks on other hosts: mpiexec passes SIGINT/SIGTERM on (Hydra, Open MPI)
                _send(proc, sig)
                kill_at = kill_at or now + stop_grace()
        elif terminate_at is None and kill_at is None and any_record(job_dir):
            terminate_at = now + ABORT_GRACE  # MPI_Abort normally ends the job long before this
        if terminate_at is not None and now >= terminate_at and kill_at is None:
            _send(proc, 15)
            kill_at = now + GRACE
        if kill_at is not None and now >= kill_at:
            kill_pids([*descendants(proc.pid), proc.pid])
    if signals.received or proc.returncode != 0:
        # mpiexec may exit while the ranks it killed are still going down: see them go (for the
        # report), and make sure they do.
        deadline = time.monotonic() + 1.0
        watch.wait(0)
        while watch.fds and time.monotonic() < deadline:
            watch.wait(0.05)
        _kill_stray_ranks(job_dir)
    watch.close()
    for thread in pumps:
        thread.join(timeout=5)
    if follower is not None:
        follower.stop()
    if signals.received:
        return signals.exit_code
    if proc.returncode == 0:
        return 0

    code = proc.returncode
    records = read_records(job_dir)
    deaths = _deaths(b"".join(tails).decode(errors="replace"), code, records, watch.dead)
    first = first_failure(records, deaths)
    name = Path(mpiexec).name
    status = f"{name} exited with {'code' if code > 0 else 'signal'} {abs(code)}"
    listed = any(d.by_launcher for d in deaths.values())  # else the ranks ran where the launcher cannot see
    sys.stderr.write(failure_report(first, start, records, deaths, stopper=f"{name} ({status})",
                                    others="" if listed else f"stopped by {name}; {status}") + "\n")
    sys.stderr.flush()
    signalled = deaths[first].code if first in deaths and not deaths[first].by_launcher else None
    if signalled is not None and signalled < 0:
        return 128 - signalled  # as a shell reports it (Hydra exits with the bare signal number)
    return code if code > 0 else 128 - code


def _send(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


def _check_library(mpiexec: str, flavor: Flavor) -> None:
    """mpi4py on one MPI under another's mpiexec makes N worlds of one rank each: refuse."""
    try:
        library = library_version()
    except Exception:  # noqa: BLE001 - the ranks will report a missing mpi4py themselves
        return
    family = classify(library)
    if {family, flavor.family} == {"mpich", "openmpi"}:
        first_line = library.strip().splitlines()[0] if library.strip() else "?"
        raise LaunchError(
            f"phalanx run: {mpiexec} is {flavor.family} ({flavor.banner}) but mpi4py uses {family} "
            f"({first_line}); every rank would start a world of its own. Pass the matching mpiexec with "
            "--mpiexec, or point mpi4py at the other library (MPI4PY_LIBMPI, see mpi4py's docs)."
        )


def _pid_files(job_dir: str, skip: set[int] | frozenset[int] = frozenset()) -> dict[int, tuple[int, str]]:
    """rank -> (pid, host), from the ``pid-rank<r>`` files the workers wrote."""
    found = {}
    try:
        names = os.listdir(job_dir)
    except OSError:
        return found
    for name in names:
        if name.startswith("pid-rank") and name[8:].isdigit() and int(name[8:]) not in skip:
            try:
                with open(os.path.join(job_dir, name)) as f:
                    pid, host = f.read().split()
                found[int(name[8:])] = (int(pid), host)
            except (OSError, ValueError):
                continue
    return found


def _deaths(text: str, code: int, records: dict[int, dict[str, object]],
            seen: dict[int, float]) -> dict[int, Death]:
    """How the ranks without a failure record ended, and which of them failed first.

    Open MPI names the failing rank and its status. Hydra names neither reliably (its
    "PID ... RUNNING AT" line is often another rank that it killed afterwards) but its
    "EXIT STRING" and exit status are the failing rank's: the rank is the one the launcher
    saw die first.
    """
    deaths = {rank: Death(at=at, by_launcher=True) for rank, at in seen.items() if rank not in records}
    found = False
    # Open MPI: "process rank 1 with PID 4242 on node x exited on\nsignal 9 (Killed)."
    for rank, sig in re.findall(r"process rank (\d+) with PID \d+ on node \S+ exited on\s+signal (\d+)", text):
        deaths[int(rank)] = Death(-int(sig), seen.get(int(rank)))
        found = True
    # Open MPI 4: "Process name: [[1234,1],1]\n  Exit code: 3"; 5: "[prterun-host-1234@1,1]"
    for rank, status in re.findall(r"Process name:\s*\[\S*?,(\d+)\]\s*\n\s*Exit code:\s*(\d+)", text):
        deaths[int(rank)] = Death(int(status), seen.get(int(rank)))
        found = True
    causes = [r for r, rec in records.items() if rec.get("type") not in ECHOES]
    if not found and not causes and deaths:
        first = min(deaths, key=lambda r: (deaths[r].at or 0.0, r))
        sig = re.search(r"EXIT STRING: .*\(signal (\d+)\)", text)
        deaths[first].code = -int(sig.group(1)) if sig else (code if code > 0 else None)
        deaths[first].by_launcher = False
        if deaths[first].code == -signal.SIGKILL and len(deaths) > 1:
            # Hydra stops the other ranks with SIGKILL too, and a killed process can take longer to
            # go than its peers take to be killed: the order seen is then the only (weak) clue.
            deaths[first].notes.append(f"(Hydra kills the other ranks with SIGKILL too; rank {first} is the "
                                       "first rank the launcher saw die, which is usually the one that failed.)")
    return deaths


class _Watch:
    """Notices the moment each rank on this host exits (Linux pidfds; elsewhere it sees nothing).

    The ranks are mpiexec's grandchildren, so their exit status is out of reach, but the
    order of their deaths tells which one failed first."""

    def __init__(self, job_dir: str) -> None:
        self.job_dir = job_dir
        self.fds: dict[int, int] = {}  # pidfd -> rank
        self.known: set[int] = set()
        self.dead: dict[int, float] = {}
        self.poller = select.poll() if hasattr(os, "pidfd_open") else None

    def wait(self, timeout: float) -> None:
        if self.poller is None:
            time.sleep(timeout)
            return
        for rank, (pid, host) in _pid_files(self.job_dir, skip=self.known).items():
            self.known.add(rank)
            if host != _HOST:
                continue
            try:
                fd = os.pidfd_open(pid)
            except OSError:  # already gone
                continue
            self.fds[fd] = rank
            self.poller.register(fd, select.POLLIN)
        ready = self.poller.poll(timeout * 1000)
        now = time.time()
        for fd, _ in ready:
            self.dead[self.fds.pop(fd)] = now
            self.poller.unregister(fd)
            os.close(fd)
        if not self.fds and timeout:
            time.sleep(timeout)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()


def _signal_local_ranks(job_dir: str, n: int, sig: int) -> bool:
    """Send ``sig`` to every rank directly when all ``n`` run on this host; False (nothing sent) otherwise."""
    ranks = _pid_files(job_dir)
    if len(ranks) != n or any(host != _HOST for _, host in ranks.values()):
        return False
    for pid, _ in ranks.values():
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            continue
    return True


def _kill_stray_ranks(job_dir: str) -> None:
    """Workers on this host that outlived mpiexec (it should never happen, but no orphans)."""
    for pid, host in _pid_files(job_dir).values():
        if host != _HOST:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"phalanx.cli._worker" in f.read():
                    kill_pids([pid])
        except OSError:
            continue
