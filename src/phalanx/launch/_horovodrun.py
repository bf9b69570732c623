"""horovodrun's command line on ``phalanx run``: a user changes only the first word.

::

    horovodrun -np 4 -H h0:2,h1:2 --gloo python train.py
    phalanx run -np 4 -H h0:2,h1:2 --gloo python train.py      # "python" is optional

Each horovodrun flag either means what it means there, in phalanx's terms
(``-np`` is ``-n``, ``-H`` is ``--hosts``, ``--gloo``/``--mpi`` pick the
backend, ``-p``/``-i`` go to ssh, ``--network-interface`` is ``--iface``,
``--output-filename`` is ``--log-dir``, ``--timeline-filename`` sets
``HOROVOD_TIMELINE``), or is refused before anything starts with a message
that names it and says what phalanx does instead (:data:`UNSUPPORTED`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from .._errors import LaunchError
from ._job import DEFAULT_START_TIMEOUT, seconds_from_env

__all__ = ["UNSUPPORTED", "VALUED", "add_horovodrun_options", "apply_horovodrun", "check_supported", "describe_job",
           "job_env", "ssh_rsh", "strip_python"]

# horovodrun's flags that take a value (for splitting the command line before the script).
VALUED = {"-np", "--num-proc", "-H", "-hostfile", "-p", "--ssh-port", "-i", "--ssh-identity-file",
          "--network-interface", "--network-interfaces", "--output-filename", "--timeline-filename",
          "--gloo-timeout-seconds", "--min-np", "--min-num-proc", "--max-np", "--max-num-proc"}

_TUNING = ("phalanx has no fusion buffer, background cycle or response cache to tune: the gradient engine of "
           "phalanx.torch reduces in buckets while backward runs (bucket_cap_mb=, default 25 MB)")
_ALGORITHMS = ("phalanx's collectives are the backend's own (MPI's or gloo's algorithms); there is no "
               "hierarchical mode to choose")
_STALL = ("phalanx does not warn about stalls, it ends them: a collective that waits longer than --timeout S "
          "raises CollectiveTimeoutError on every rank, naming the ranks that never came")
_LOGGING = ("phalanx has no background log: its errors name the rank and the call (PHALANX_DEBUG=1 adds each "
            "rank's line of code), and --log-dir DIR prefixes each line of output with its rank")
_ELASTIC = ("phalanx's elastic jobs keep -np ranks, replacing lost ones on the hosts given (--max-restarts K) "
            "or going on with fewer (--min-np M); hosts are not discovered while the job runs (docs/horovod.md)")
_AUTOTUNE = "phalanx has no autotuner (no fusion threshold or cycle time to tune)"

UNSUPPORTED: dict[str, str] = {
    "-cb": "phalanx has no build to check: `phalanx info` lists the backends, MPI and GPUs found here",
    "--check-build": "phalanx has no build to check: `phalanx info` lists the backends, MPI and GPUs found here",
    "-v": "`phalanx --version` prints phalanx's version",
    "--version": "`phalanx --version` prints phalanx's version",
    "--config-file": "Horovod's YAML file sets Horovod's tuning parameters, which phalanx does not have; give "
                     "phalanx run's own flags on the command line",
    "--fusion-threshold-mb": _TUNING, "--cycle-time-ms": _TUNING, "--cache-capacity": _TUNING,
    "--hierarchical-allreduce": _ALGORITHMS, "--no-hierarchical-allreduce": _ALGORITHMS,
    "--hierarchical-allgather": _ALGORITHMS, "--no-hierarchical-allgather": _ALGORITHMS,
    "--autotune": _AUTOTUNE, "--no-autotune": _AUTOTUNE, "--autotune-log-file": _AUTOTUNE,
    "--autotune-warmup-samples": _AUTOTUNE, "--autotune-steps-per-sample": _AUTOTUNE,
    "--autotune-bayes-opt-max-samples": _AUTOTUNE, "--autotune-gaussian-process-noise": _AUTOTUNE,
    "--no-stall-check": _STALL, "--stall-check": _STALL, "--stall-check-warning-time-seconds": _STALL,
    "--stall-check-shutdown-time-seconds": _STALL,
    "--mpi-threads-disable": "phalanx lets mpi4py initialize MPI at its own thread level (set "
                             "mpi4py.rc.thread_level in the script to change it)",
    "--no-mpi-threads-disable": "phalanx lets mpi4py initialize MPI at its own thread level",
    "--tcp": "choose MPI's transport through mpiexec: --mpi-args='...' (e.g. Open MPI's --mca btl tcp,self); "
             "gloo always uses TCP",
    "--binding-args": "give binding options to mpiexec with --mpi-args, e.g. --mpi-args='--bind-to core'",
    "--num-nccl-streams": "the nccl backend is torch.distributed's, which has no stream-count option",
    "--thread-affinity": "phalanx has no background thread to pin",
    "--log-level": _LOGGING, "--log-with-timestamp": _LOGGING, "--log-without-timestamp": _LOGGING,
    "--log-hide-timestamp": _LOGGING, "--no-log-hide-timestamp": _LOGGING,
    "-prefix-timestamp": _LOGGING, "--prefix-output-with-timestamp": _LOGGING,
    "--host-discovery-script": _ELASTIC, "--slots-per-host": _ELASTIC,
    "--elastic-timeout": _ELASTIC, "--reset-limit": _ELASTIC, "--blacklist-cooldown-range": _ELASTIC,
    "--jsrun": "phalanx starts MPI jobs with mpiexec (pass options with --mpi-args); LSF's jsrun is not "
               "supported",
}


def check_supported(arg: str) -> None:
    """Raise LaunchError naming ``arg`` when it is a horovodrun flag phalanx does not take, and why."""
    flag = arg.split("=", 1)[0]
    reason = UNSUPPORTED.get(flag)
    if reason is not None:
        raise LaunchError(f"phalanx run {flag}: horovodrun's option is not supported: {reason}.")


def add_horovodrun_options(parser: argparse.ArgumentParser) -> None:
    """horovodrun's spellings that ``phalanx run`` takes besides its own (``-np``, ``-H`` are aliases)."""
    group = parser.add_argument_group("horovodrun's flags", "accepted so that a horovodrun command line runs "
                                      "with only its first word changed (-np = -n, -H = --hosts, "
                                      "-hostfile = --hostfile)")
    group.add_argument("--gloo", action="store_true", help="the gloo backend (= --backend gloo)")
    group.add_argument("--mpi", action="store_true", help="the mpi backend (= --backend mpi)")
    group.add_argument("-p", "--ssh-port", type=int, metavar="PORT", help="with --hosts: ssh's port on every host "
                       "(adds -p PORT to ssh or --rsh)")
    group.add_argument("-i", "--ssh-identity-file", metavar="FILE", help="with --hosts: ssh's identity file "
                       "(adds -i FILE to ssh or --rsh)")
    group.add_argument("--network-interface", "--network-interfaces", dest="nics", action="append",
                       metavar="NAME", help="= --iface NAME (one interface)")
    group.add_argument("--output-filename", metavar="DIR", help="= --log-dir DIR: each rank's output in "
                       "DIR/rank.<r>.log (not horovodrun's DIR/rank.<r>/stdout and stderr)")
    group.add_argument("--timeline-filename", metavar="FILE", help="rank 0 writes a Chrome-trace timeline of "
                       "the collectives to FILE (sets HOROVOD_TIMELINE for phalanx.horovod.torch)")
    group.add_argument("--timeline-mark-cycles", action="store_true", help="with --timeline-filename: mark "
                       "each gradient-reduction cycle (HOROVOD_TIMELINE_MARK_CYCLES=1)")
    group.add_argument("--no-timeline-mark-cycles", dest="timeline_mark_cycles", action="store_false",
                       help=argparse.SUPPRESS)
    group.add_argument("--gloo-timeout-seconds", type=float, metavar="S", help="= --timeout S")
    group.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int, metavar="M",
                       help="= --min-ranks M: the fewest ranks an elastic job goes on with (hvd.elastic.run resets "
                            "in place on gloo)")
    group.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int, metavar="N",
                       help="the most ranks an elastic job grows to: phalanx keeps -np ranks (lost ones are "
                            "replaced while --max-restarts allow), so N must be at least -np")
    group.add_argument("--verbose", action="store_true", help="say how the job is started (ranks, backend, "
                       "hosts, remote shell, logs) before starting it")
    group.add_argument("--disable-cache", action="store_true", help="accepted and ignored: phalanx caches no "
                       "host checks")


def strip_python(target: list[str]) -> list[str]:
    """``python train.py``/``python -m pkg`` (horovodrun's form) as ``train.py``/``-m pkg``.

    phalanx runs every rank with its own Python; a first word naming a Python
    interpreter is dropped (another program is refused: phalanx runs Python).
    """
    if not target or target[0] == "-m" or os.path.isfile(target[0]) and target[0].endswith(".py"):
        return target
    name = os.path.basename(target[0])
    if name.startswith("python") and len(target) > 1:
        rest = target[1:]
        if rest[0] == "-u":  # unbuffered: every rank's output already is
            rest = rest[1:]
        return rest
    return target


def _one_nic(args: argparse.Namespace) -> str | None:
    nics = [n for value in args.nics or [] for n in value.split(",") if n]
    if len(set(nics)) > 1:
        raise LaunchError(f"phalanx run --network-interface: got {', '.join(sorted(set(nics)))}; phalanx's ranks "
                          "use one interface across hosts: give one, e.g. --network-interface eth0.")
    nic = nics[0] if nics else None
    if nic and args.iface and nic != args.iface:
        raise LaunchError(f"phalanx run: --network-interface {nic} and --iface {args.iface} disagree; give one.")
    return nic or args.iface


def _backend(args: argparse.Namespace) -> str | None:
    if args.gloo and args.mpi:
        raise LaunchError("phalanx run: got both --gloo and --mpi; give one (or --backend gloo|mpi|nccl).")
    chosen = "gloo" if args.gloo else "mpi" if args.mpi else None
    if chosen and args.backend and args.backend != chosen:
        raise LaunchError(f"phalanx run: --{chosen} and --backend {args.backend} disagree; give one.")
    return chosen or args.backend


def apply_horovodrun(args: argparse.Namespace) -> None:
    """Fold horovodrun's flags into ``phalanx run``'s own (``args`` is changed in place)."""
    args.backend = _backend(args)
    args.iface = _one_nic(args)
    if args.output_filename:
        if args.log_dir and os.path.abspath(args.log_dir) != os.path.abspath(args.output_filename):
            raise LaunchError(f"phalanx run: --output-filename {args.output_filename} and --log-dir {args.log_dir} "
                              "disagree; give one.")
        args.log_dir = args.output_filename
    if args.gloo_timeout_seconds is not None:
        if args.timeout is not None and args.timeout != args.gloo_timeout_seconds:
            raise LaunchError(f"phalanx run: --gloo-timeout-seconds {args.gloo_timeout_seconds:g} and --timeout "
                              f"{args.timeout:g} disagree; give one.")
        args.timeout = args.gloo_timeout_seconds
    if args.start_timeout is None and os.environ.get("HOROVOD_START_TIMEOUT", "").strip() \
            and not os.environ.get("PHALANX_START_TIMEOUT", "").strip():
        args.start_timeout = seconds_from_env("HOROVOD_START_TIMEOUT", DEFAULT_START_TIMEOUT)
    if args.min_np is not None:
        if args.min_ranks is not None and args.min_ranks != args.min_np:
            raise LaunchError(f"phalanx run: --min-np {args.min_np} and --min-ranks {args.min_ranks} disagree; give one.")
        args.min_ranks = args.min_np
    if args.max_np is not None and args.n is not None and args.max_np < args.n:
        raise LaunchError(f"phalanx run -np {args.n} --max-np {args.max_np}: the job starts with -np ranks, more "
                          f"than --max-np allows; give --max-np {args.n} or more (or a smaller -np).")
    if args.timeline_mark_cycles and not args.timeline_filename:
        raise LaunchError("phalanx run --timeline-mark-cycles: it marks cycles in the timeline; give the file "
                          "too, e.g. --timeline-filename timeline.json.")


def ssh_rsh(args: argparse.Namespace, rsh: str | None) -> str | None:
    """``rsh`` (default ssh) with ``-p PORT``/``-i FILE`` added when horovodrun's ssh flags were given."""
    extra: list[str] = []
    if args.ssh_port is not None:
        extra += ["-p", str(args.ssh_port)]
    if args.ssh_identity_file:
        extra += ["-i", os.path.expanduser(args.ssh_identity_file)]
    if not extra:
        return rsh
    return shlex.join([*(shlex.split(rsh) if rsh else ["ssh"]), *extra])


def job_env(args: argparse.Namespace) -> dict[str, str]:
    """The variables horovodrun's flags set for the ranks (the timeline's)."""
    env: dict[str, str] = {}
    if args.timeline_filename:
        env["HOROVOD_TIMELINE"] = os.path.abspath(args.timeline_filename)
        if args.timeline_mark_cycles:
            env["HOROVOD_TIMELINE_MARK_CYCLES"] = "1"
    return env


def describe_job(job: object) -> None:
    """``--verbose``: how the job will be started, on stderr."""
    get = job.__dict__.get
    hosts = get("hosts")
    lines = [f"{get('n')} ranks of {shlex.join(get('target') or [])} on backend {get('backend')}",
             f"hosts: {','.join(str(h) for h in hosts)}" if hosts else "hosts: this one",
             f"remote shell: {get('rsh') or 'ssh'}" if hosts else "",
             f"network interface: {get('iface')}" if get("iface") else "",
             f"each rank's output: {get('log_dir')}/rank.<r>.log" if get("log_dir") else "",
             f"collective timeout: {get('timeout'):g} s" if get("timeout") else "",
             f"start timeout: {get('start_timeout'):g} s" if get("start_timeout") else "",
             f"environment: {', '.join(f'{k}={v}' for k, v in sorted((get('env') or {}).items()))}"
             if get("env") else ""]
    for line in filter(None, lines):
        sys.stderr.write(f"phalanx run: {line}\n")
    sys.stderr.flush()
