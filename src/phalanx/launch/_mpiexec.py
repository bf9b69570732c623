"""MPI jobs: build the ``mpiexec`` command, supervise it, explain how the job ended.

``run_mpi`` is three steps: :func:`mpi_command` (which mpiexec, with the
arguments its implementation needs; MPICH's ``mpiexec.gforker`` when every rank
runs here, so that nothing listens beyond loopback), :class:`_Supervisor` (passes the user's
signals on, ends a job whose failing rank's ``MPI_Abort`` did not, and a job
whose ranks do not all reach ``phalanx.init`` in time, when every rank runs on
this host) and :func:`_report` (names the rank that failed first, from the
failure records, mpiexec's output and the order the ranks were seen to die).
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from .._errors import LaunchError
from .._failure import RAISED_STATUS
from . import _keeper as keeper
from ._job import GRACE, ONE_HOST, Launch, Signals, all_local, notice, worker_command
from ._jobdir import any_record, marked_ranks, pid_files, read_records, read_statuses
from ._logs import FileFollower, log_path, pump
from ._mpi_deaths import HOST, RecordSink, Watch, can_watch_deaths, deaths_from
from ._mpi_flavor import (
    FORKER,
    INSTALL_HINT,
    check_library,
    find_mpiexec,
    hydra_args,
    loopback_env,
    mpiexec_flavor,
    openmpi_args,
    single_host_forker,
)
from ._mpi_hosts import host_args
from ._mpi_in_place import count_replacements, every_slot_finished, in_place_mpi, name_forwarded, re_forms
from ._procs import child_setup, descendants, kill_pids
from ._report import failure_report, first_failure
from ._spawn import free_port
from ._start import StartClock

__all__ = ["mpi_command", "run_mpi"]

ABORT_GRACE = 5.0  # after a rank recorded an exception, how long mpiexec may take to end the job itself


def mpi_command(job: Launch, env: dict[str, str], job_dir: str) -> tuple[list[str], bool]:
    """The mpiexec command line for ``job``, and whether the launcher (not mpiexec) stops the ranks
    after a failure; adjusts ``env`` (what the ranks must and must not inherit). A host file or rsh
    wrapper it needs is written into ``job_dir``."""
    mpiexec = find_mpiexec(job.mpiexec)
    if mpiexec is None:
        where = f"--mpiexec {job.mpiexec!r} is not an executable" if job.mpiexec else "no mpiexec was found"
        raise LaunchError(f"phalanx run --backend mpi: {where}; {INSTALL_HINT}.")
    flavor = mpiexec_flavor(mpiexec)
    check_library(mpiexec, flavor)
    ours = ["PHALANX_BACKEND", "PHALANX_JOB_DIR", "PYTHONUNBUFFERED", "OMP_NUM_THREADS", *job.env]
    if "PHALANX_TIMEOUT" in env:
        ours.append("PHALANX_TIMEOUT")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):  # these would name the wrong rank
        env.pop(name, None)
    # torch.distributed's env:// rendezvous (a script's init_process_group("phalanx")) reads these; the
    # worker sets RANK and the rest per rank (_worker.torchrun_variables). Only such a script listens.
    env.setdefault("MASTER_ADDR", "127.0.0.1" if all_local(job) or not job.hosts else job.hosts[0].name)
    env.setdefault("MASTER_PORT", str(free_port()))
    ours += ["MASTER_ADDR", "MASTER_PORT"]
    if all_local(job):  # every rank here: a local rank is the rank (MPICH's forker sets no local rank)
        env[ONE_HOST] = "1"
        ours.append(ONE_HOST)
    if job.log_dir is not None:
        env["PHALANX_LOG_DIR"] = job.log_dir
        ours.append("PHALANX_LOG_DIR")
        for rank in range(job.n):
            open(log_path(job.log_dir, rank), "wb").close()  # workers append; old runs' text must go
    local = all_local(job)
    if local and not (job.iface or env.get("PHALANX_IFACE")):  # nothing needs to reach these ranks from another host
        loopback_env(env)
    in_place = in_place_mpi(job, flavor, env, ours)
    placing = host_args(job, flavor.family, mpiexec, job_dir, env, ours)
    watched = local and can_watch_deaths()  # the launcher can stop the ranks itself only where it sees each end
    forker = single_host_forker(mpiexec, flavor) if watched and not job.mpi_args else None
    if forker is not None:  # no control port (Hydra's binds 0.0.0.0); the keeper reports signals, see run_mpi
        env[keeper.ENV] = "1"
        return [forker, "-n", str(job.n), *worker_command(job.target)], True
    if flavor.family == "openmpi":  # every PHALANX_* the ranks' environment has reaches them on every host
        ours += sorted(name for name in env if name.startswith("PHALANX_") and name not in ours)
        if in_place:
            name_forwarded(env, ours)
        extra = openmpi_args(job, flavor, env, ours)
        if in_place:  # ULFM: a lost rank's peers are told, and the job goes on (the ranks re-form it)
            cmd = [mpiexec, "-n", str(job.n), "--with-ft", "ulfm", *extra, *placing, *job.mpi_args,
                   *worker_command(job.target)]
            return cmd, False
    else:
        extra = hydra_args(flavor.banner, watched)
        if extra:  # the launcher stops the ranks: Hydra must not see a rank die by a signal (_keeper)
            env[keeper.ENV] = "1"
    cmd = [mpiexec, "-n", str(job.n), *extra, *placing, *job.mpi_args, *worker_command(job.target)]
    return cmd, bool(extra) and local


def run_mpi(job: Launch, env: dict[str, str], job_dir: str, signals: Signals) -> int:
    """Run ``job`` under mpiexec until it ends; returns the exit status (a report on stderr if it failed)."""
    cmd, own_cleanup = mpi_command(job, env, job_dir)
    start = time.time()
    proc, out, err = _start(cmd, env)
    tails = (bytearray(), bytearray())
    records = RecordSink(job_dir)  # failures of ranks on other hosts arrive on stderr
    pumps = [pump(out, [sys.stdout.buffer], tail=tails[0]),
             pump(err, [records], tail=tails[1])]
    follower = FileFollower(job.log_dir, job.n, job.echo).start() if job.log_dir is not None else None
    watch = Watch(job_dir)
    # Ranks on other hosts cannot leave their init/ready markers in this host's job dir: the start
    # timeout is only kept where every rank runs here.
    timeout = (job.start_timeout or float("inf")) if all_local(job) else float("inf")
    clock = StartClock(job_dir, job.n, timeout)
    supervisor = _Supervisor(job, proc, job_dir, signals, watch, clock, own_cleanup, records, in_place=re_forms(env))
    try:
        supervisor.run()
    finally:
        watch.close()
        for thread in pumps:
            thread.join(timeout=5)
        records.close()
        if proc.stdout is None:  # our own pipes (_start): the pumps are done with them
            for stream in (out, err):
                stream.close()
        if follower is not None:
            follower.stop()
    if re_forms(env):
        count_replacements(job, job_dir)
    if signals.received:
        return signals.exit_code
    if proc.returncode != 0 and re_forms(env) and every_slot_finished(job, job_dir):
        notice(f"{Path(cmd[0]).name} exited with status {proc.returncode} for the ranks lost during the job, "
               f"but the world re-formed in place and every slot's last process finished its script.")
        return 0
    code = proc.returncode
    if code == 0 and re_forms(env) and any_record(job_dir):
        code = RAISED_STATUS  # under ULFM, mpirun may exit 0 after a rank's MPI_Abort
    if code == 0:
        lost = [] if all_local(job) else _unfinished_here(job_dir, watch)
        if not lost:
            return 0
        kill_pids(supervisor.local_ranks())  # mpiexec has gone: nothing else stops a rank it left behind
        sys.stderr.write(f"phalanx run: {Path(cmd[0]).name} exited with status 0, but rank(s) {lost} on this host "
                         f"({HOST}) ended without finishing: the processes of another host were lost (Open MPI "
                         "ends a job that way when a host's daemon dies). The job failed.\n")
        return 1
    if clock.report is not None and not any_record(job_dir):
        sys.stderr.write(clock.report + "\n")
        return 1
    return _report(Path(cmd[0]).name, code, b"".join(tails).decode(errors="replace"),
                   job_dir, watch, start, supervisor.culprit, across=not all_local(job),
                   aborted=records.aborted if own_cleanup else None)


def _start(cmd: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[bytes], IO[bytes], IO[bytes]]:
    """Start mpiexec; its stdout and stderr (and the ranks') as pipes to read.

    Under the forker each rank writes to these pipes itself (``_keeper.STDIO_ENV``), and rank 0
    reads the launcher's stdin (the forker gives its ranks ``/dev/null`` and copies their output
    one byte per write)."""
    if Path(cmd[0]).name != FORKER:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=child_setup(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout is not None and proc.stderr is not None
        return proc, proc.stdout, proc.stderr
    (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
    try:
        stdin = fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, 3)
    except OSError:  # no stdin: rank 0 keeps the forker's /dev/null
        stdin = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    passed = [stdin, *(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3) for fd in (out_w, err_w))]  # none below 3
    env = {**env, keeper.STDIO_ENV: ",".join(map(str, passed))}
    try:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=child_setup(),
                                stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w, pass_fds=passed)
    except BaseException:
        for fd in (out_r, err_r):
            os.close(fd)
        raise
    finally:
        for fd in (out_w, err_w, *passed):
            os.close(fd)
    return proc, os.fdopen(out_r, "rb", 0), os.fdopen(err_r, "rb", 0)


class _Supervisor:
    """Watches mpiexec until it exits; ends the job itself when mpiexec does not."""

    def __init__(self, job: Launch, proc: subprocess.Popen[bytes], job_dir: str, signals: Signals,
                 watch: Watch, clock: StartClock, own_cleanup: bool = False,
                 records: RecordSink | None = None, in_place: bool = False) -> None:
        self.job, self.proc, self.job_dir, self.signals, self.watch = job, proc, job_dir, signals, watch
        self.clock = clock
        self.records = records  # mpiexec's stderr: which rank called MPI_Abort
        self.forker = Path(str(proc.args[0] if isinstance(proc.args, list) else proc.args)).name == FORKER
        self.own_cleanup = own_cleanup  # mpiexec leaves the other ranks running when one dies
        self.culprit: int | None = None  # the rank that ended by itself first, when own_cleanup
        self.forwarded = 0
        self.terminate_at: float | None = None  # when to SIGTERM mpiexec ourselves
        self.kill_at: float | None = None  # when to SIGKILL mpiexec and everything below it
        self.in_place = in_place  # the world re-forms in place (ULFM): a rank's end is not the job's

    def run(self) -> None:
        while self.proc.poll() is None:
            self.watch.wait(0.05)
            self.step(time.monotonic())
        if self.signals.received or self.proc.returncode != 0:
            # mpiexec may exit while the ranks it killed are still going down: see them go (for the
            # report), and make sure they do.
            deadline = time.monotonic() + 1.0
            self.watch.wait(0)
            while self.watch.fds and time.monotonic() < deadline:
                self.watch.wait(0.05)
            _kill_stray_ranks(self.job_dir)

    def step(self, now: float) -> None:
        signals = self.signals
        if signals.count > self.forwarded:
            self.forwarded = signals.count
            sig = signals.received or 15
            if self.forwarded > 1:
                self.kill_at = now  # a second Ctrl-C: no more waiting
            elif _signal_local_ranks(self.job_dir, self.job.n, sig):
                # Every rank runs here and got the signal itself: mpiexec is left alone, because Open MPI's
                # kills the ranks a second after forwarding one, too soon for a checkpoint.
                self.terminate_at = now + signals.stop_grace
            else:  # ranks on other hosts: mpiexec passes SIGINT/SIGTERM on (Hydra, Open MPI)
                _send(self.proc, sig)
                self.kill_at = self.kill_at or now + signals.stop_grace
        elif self.own_cleanup and self.culprit is None and self.kill_at is None and self.records is not None \
                and self.records.aborted is not None:
            self.stop_after_abort(now, self.records.aborted[0])
        elif self.terminate_at is None and self.kill_at is None and any_record(self.job_dir):
            self.terminate_at = now + ABORT_GRACE  # MPI_Abort normally ends the job long before this
        elif self.terminate_at is None and self.kill_at is None and not self.own_cleanup and not self.in_place \
                and set(self.watch.dead) - _clean(self.job_dir, self.watch):
            # a rank here ended unfinished (killed, or aborted inside MPI: no record): mpiexec normally ends
            # the job at once, but Open MPI 5's can hang in its teardown across hosts after every rank is gone
            self.terminate_at = now + ABORT_GRACE
        elif self.terminate_at is None and self.kill_at is None and self.clock.overdue(now):
            self.terminate_at = now  # ranks wait in MPI_Init for one that never comes: end it now
        elif self.own_cleanup and self.culprit is None and self.terminate_at is None and self.kill_at is None:
            self.stop_after_failure(now)
        ending = self.culprit is not None or self.terminate_at is not None or self.forwarded
        if self.forker and ending and (self.kill_at or now) >= now and len(self.watch.dead) >= self.job.n:
            # Every rank has ended: the forker has nothing left to do but its own clean-up, which
            # signals ranks already gone with a second's pause between signals.
            self.kill_at = now
        if self.terminate_at is not None and now >= self.terminate_at and self.kill_at is None:
            if self.forker:  # its signals reach only the keepers, which ignore them
                kill_pids(self.local_ranks())
            _send(self.proc, 15)
            self.kill_at = now + GRACE
        if self.kill_at is not None and now >= self.kill_at:
            kill_pids([*descendants(self.proc.pid), self.proc.pid])


    def stop_after_failure(self, now: float) -> None:
        """The first rank that ended by itself, not cleanly, is the failure: stop the others now.

        Clean: the worker's ``exit-rank<r>`` marker, or exit status 0 where it could be read.

        Every other rank is still running (mpiexec kills none of them), so the order is certain.
        They get SIGKILL, as Hydra would have sent: they are blocked in MPI calls with a dead peer,
        where no Python signal handler runs. mpiexec then ends by itself.
        """
        if not self.watch.dead:
            return
        clean = _clean(self.job_dir, self.watch)
        ended = sorted((at, rank) for rank, at in self.watch.dead.items() if rank not in clean)
        if not ended:
            return
        self.culprit = ended[0][1]
        kill_pids(self.local_ranks())
        self.terminate_at = now + ABORT_GRACE

    def stop_after_abort(self, now: float, rank: int) -> None:
        """Rank ``rank`` called ``MPI_Abort``: it failed first, and the others stop now (SIGKILL, as
        Hydra does). Under the forker the keepers shield every rank from the forker's own SIGINT and
        SIGQUIT, and the aborting rank may return from ``MPI_Abort``: nobody else would stop them."""
        self.culprit = rank
        kill_pids(self.local_ranks())
        self.terminate_at = self.terminate_at or now + ABORT_GRACE

    def local_ranks(self) -> list[int]:
        """The pids of the ranks on this host that have not been seen to end."""
        return [pid for rank, (pid, host) in pid_files(self.job_dir).items()
                if host == HOST and rank not in self.watch.dead]


def _clean(job_dir: str, watch: Watch) -> set[int]:
    """The ranks that ended cleanly: the worker's ``exit-rank<r>`` marker, or exit status 0 where it was read."""
    return marked_ranks(job_dir, "exit") | {r for r, code in watch.status.items() if code == 0}


def _unfinished_here(job_dir: str, watch: Watch) -> list[int]:
    """The ranks on this host that did not end cleanly (:func:`_clean`)."""
    clean = _clean(job_dir, watch)
    return sorted(r for r, (_, host) in pid_files(job_dir).items() if host == HOST and r not in clean)


def _report(name: str, code: int, output: str, job_dir: str, watch: Watch, start: float,
            culprit: int | None, across: bool = False, aborted: tuple[int, int] | None = None) -> int:
    """Print the failure report; return the job's exit status: the first rank's where it raised
    (:data:`phalanx._failure.RAISED_STATUS`) or where the launcher saw it end first (a killed one's as a shell shows
    it), else mpiexec's.

    ``across``: ranks may run on other hosts, whose deaths only mpiexec sees; the report names hosts.
    ``aborted``: the rank that called ``MPI_Abort`` and its error code (:attr:`RecordSink.aborted`)."""
    if code < 0 and aborted is not None and aborted[1] > 0:
        code = aborted[1]  # the launcher ended mpiexec (the forker) after MPI_Abort: the status it would have had
    records = read_records(job_dir)
    statuses = {**watch.status, **{rank: code for rank, (code, _) in read_statuses(job_dir).items()}}
    deaths = deaths_from(output, code, records, watch.dead, culprit, statuses,
                         pids=pid_files(job_dir) if across else None)
    if aborted is not None and aborted[0] == culprit and culprit in deaths:
        rank, error = aborted
        deaths[rank].code = error or deaths[rank].code  # the launcher's SIGKILL ended it: not the cause
        deaths[rank].notes.append(f"Rank {rank} called MPI_Abort(MPI_COMM_WORLD, {error}).")
    first = first_failure(records, deaths)
    status = f"{name} exited with {'code' if code > 0 else 'signal'} {abs(code)}"
    listed = any(d.by_launcher for d in deaths.values())  # else the ranks ran where the launcher cannot see
    stopper = "the launcher" if culprit is not None else f"{name} ({status})"
    sys.stderr.write(failure_report(first, start, records, deaths, stopper=stopper,
                                    others="" if listed else f"stopped by {name}; {status}",
                                    name_hosts=across) + "\n")
    sys.stderr.flush()
    if first in records:  # it raised: its own status (mpiexec's can be another rank's, e.g. Open MPI's 14
        return RAISED_STATUS  # for a peer's lost socket); a KeyboardInterrupt leaves no record (_worker)
    signalled = deaths[first].code if first in deaths and not deaths[first].by_launcher else None
    if signalled is not None and signalled < 0:
        return 128 - signalled  # as a shell reports it (Hydra exits with the bare signal number)
    if signalled and culprit is not None:  # mpiexec's status merges the others' (the launcher's SIGKILLs)
        return signalled
    return code if code > 0 else 128 - code


def _send(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


def _signal_local_ranks(job_dir: str, n: int, sig: int) -> bool:
    """Send ``sig`` to every rank directly when all ``n`` run on this host; False (nothing sent) otherwise."""
    ranks = pid_files(job_dir)
    if len(ranks) != n or any(host != HOST for _, host in ranks.values()):
        return False
    for pid, _ in ranks.values():
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            continue
    return True


def _kill_stray_ranks(job_dir: str) -> None:
    """Workers on this host that outlived mpiexec (it should never happen, but no orphans)."""
    for pid, host in pid_files(job_dir).values():
        if host != HOST:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"phalanx.launch._worker" in f.read():
                    kill_pids([pid])
        except OSError:
            continue
