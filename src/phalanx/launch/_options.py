"""``phalanx run``'s options: parsed, checked and turned into a :class:`~phalanx.launch.Launch`.

::

    options, target = split_target(["-np", "2", "--gloo", "train.py", "--lr", "0.1"])
    job = job_from_args(run_parser().parse_args(options), target)

Shared by the ``phalanx run`` command and :func:`phalanx.horovod.run`, so both
take the same path from flags (phalanx's own and horovodrun's) to a job.
"""

from __future__ import annotations

import argparse
import shlex

from .._errors import LaunchError
from ._backend import default_backend
from ._horovodrun import VALUED, add_horovodrun_options, apply_horovodrun, check_supported, job_env, ssh_rsh
from ._hostlist import hosts_from_args
from ._job import Launch
from ._slurm import job_ranks, slurm_hosts

__all__ = ["USAGE", "add_run_options", "job_from_args", "run_parser", "split_target"]

USAGE = ("phalanx run -n N [options] script.py [args...]\n       phalanx run -n N [options] -m module [args...]\n"
         "       phalanx run -np N [horovodrun's flags] python script.py [args...]")

# Launcher options that take a value: everything before the script (or -m) belongs to phalanx.
_VALUED = {"-n", "--np", "--backend", "--log-dir", "--timeout", "--start-timeout", "--mpiexec", "--mpi-args",
           "--max-restarts", "--min-ranks", "--nnodes", "--node-rank", "--master", "--iface", "--secret-file",
           "--hosts", "--hostfile", "--rsh", *VALUED}


def split_target(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(launcher options, target)``: the target starts at the script or ``-m`` and keeps every
    later argument untouched (argparse's REMAINDER would still grab ``-m mod --flag``). A horovodrun
    flag that phalanx does not take is a LaunchError naming it."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        check_supported(arg)  # horovodrun's flags that phalanx does not take: refused by name, with the reason
        if arg == "--":
            return argv[:i], argv[i + 1:]
        if arg == "-m":
            return argv[:i], argv[i:]
        if arg.startswith("-m") and not arg.startswith("--"):  # -mpkg.mod, like python
            return argv[:i], ["-m", arg[2:], *argv[i + 1:]]
        if not arg.startswith("-") or arg == "-":
            return argv[:i], argv[i:]
        i += 2 if arg in _VALUED else 1
    return argv, []


def add_run_options(parser: argparse.ArgumentParser, *, n_default: int | None = None) -> None:
    parser.add_argument("-n", "-np", "--np", "--num-proc", dest="n", type=int, default=n_default,
                        metavar="N", help="number of processes (ranks); required on one host"
                        + (f" (default {n_default})" if n_default else "") + "; with --hosts/--hostfile the "
                        "default is their slots; inside a Slurm allocation the allocation's tasks (gloo/nccl on "
                        "several nodes: their tasks per node, the other nodes started through srun)")
    parser.add_argument("--backend", choices=("mpi", "gloo", "nccl"),
                        help="default: mpi when mpi4py and an mpiexec are installed, else nccl when "
                             "torch sees GPUs, else gloo")
    parser.add_argument("--log-dir", metavar="DIR",
                        help="write each rank's stdout+stderr to DIR/rank.<r>.log (echoed to the console "
                             "as '[r] line'). With mpi the ranks write the files themselves, so on several "
                             "nodes DIR must be on a shared file system.")
    parser.add_argument("--no-echo", dest="echo", action="store_false",
                        help="with --log-dir: do not echo the ranks' output to the console")
    parser.add_argument("--timeout", type=float, metavar="S",
                        help="seconds a collective may wait for the other ranks (sets PHALANX_TIMEOUT)")
    parser.add_argument("--start-timeout", type=float, metavar="S",
                        help="seconds every rank has to reach phalanx.init once another rank has; else the "
                             "job ends naming the missing ranks (default PHALANX_START_TIMEOUT or 600). Not applied to "
                             "mpi jobs that may place ranks on other hosts (--hosts/--hostfile, --mpi-args "
                             "naming hosts, a Slurm or other batch allocation): ranks there cannot tell this "
                             "host that they reached init")
    parser.add_argument("--mpiexec", metavar="PATH", help="the mpiexec to use (default: the one beside "
                        "this Python, e.g. from `pip install mpich`, then PATH)")
    parser.add_argument("--mpi-args", default="", metavar="'ARGS'",
                        help="extra mpiexec arguments, one quoted string, e.g. --mpi-args='--bind-to core'")
    parser.add_argument("-H", "--hosts", metavar="H0:N,H1:N",
                        help="run the ranks on these hosts, N slots (ranks) each, default 1 (mpi: through "
                             "mpiexec; gloo/nccl: one launcher per host), started through ssh or --rsh")
    parser.add_argument("-hostfile", "--hostfile", metavar="FILE",
                        help="like --hosts, from a file: one `host slots=N` (Open MPI, horovodrun), `host:N` "
                             "(MPICH) or `host` line per host; # starts a comment")
    parser.add_argument("--rsh", metavar="CMD",
                        help="with --hosts/--hostfile: the command that runs a command on another host, "
                             "ssh-style (`CMD HOST COMMAND...`; default ssh)")
    parser.add_argument("--oversubscribe", action="store_true",
                        help="with --hosts/--hostfile: allow more ranks (-n) than the hosts' slots")
    parser.add_argument("--nnodes", type=int, default=1, metavar="N",
                        help="gloo/nccl, one `phalanx run` per host (torchrun's convention): the number of hosts; "
                             "each runs -n ranks, host K's being ranks K*n..K*n+n-1. Needs --node-rank, --master "
                             "and the same PHALANX_SECRET (or --secret-file) on every host")
    parser.add_argument("--node-rank", type=int, default=0, metavar="K", help="with --nnodes: this host's "
                        "number, 0..N-1 (0 on the --master host)")
    parser.add_argument("--master", metavar="HOST[:PORT]", help="with --nnodes: where rank 0 serves the "
                        "rendezvous, the same on every host (default port 29500)")
    parser.add_argument("--iface", metavar="NAME", help="the network interface the ranks use across hosts "
                        "(sets PHALANX_IFACE; mpi: also mpiexec's -iface (MPICH) or btl/oob_tcp_if_include (Open MPI); "
                        "default: each backend's own, except that gloo ranks whose host name is a loopback "
                        "address take the interface that routes to the master)")
    parser.add_argument("--secret-file", metavar="FILE", help="with --nnodes: read the job's secret from FILE "
                        "instead of PHALANX_SECRET")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="K",
                        help="when the job fails (a rank raises or dies, a host is lost), start it again up to K "
                             "times, on the hosts that still answer; each rank gets PHALANX_RESTART_COUNT, and the "
                             "script resumes from its checkpoint (fit(..., resume='latest')). Default 0")
    parser.add_argument("--min-ranks", type=int, metavar="M",
                        help="the fewest ranks the job goes on with: a restart on fewer is refused, and with gloo "
                             "a job that re-forms in place (fit(elastic=True)) continues on as few as M (default 1)")
    add_horovodrun_options(parser)


def run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="phalanx run", usage=USAGE,
        description="Start N ranks of a script and supervise them: the first failure stops every rank "
                    "and is reported with its traceback; Ctrl-C stops everything (exit 130). Each rank "
                    "gets PHALANX_BACKEND, so `phalanx.init()` needs no arguments. Unless "
                    "OMP_NUM_THREADS is set, each rank gets cpu_count // N threads.",
    )
    add_run_options(parser)
    return parser


def job_from_args(args: argparse.Namespace, target: list[str]) -> Launch:
    """The job the parsed options describe (LaunchError for values no job can run with)."""
    apply_horovodrun(args)
    for flag, value in (("--timeout", args.timeout), ("--start-timeout", args.start_timeout)):
        if value is not None and not 0 < value < float("inf"):
            raise LaunchError(f"phalanx run {flag} {value:g}: give a positive number of seconds, e.g. {flag} 60.")
    try:
        mpi_args = shlex.split(args.mpi_args)
    except ValueError as exc:
        raise LaunchError(f"phalanx run: cannot split --mpi-args {args.mpi_args!r}: {exc}") from None
    backend = args.backend or default_backend(args.mpiexec)
    hosts = hosts_from_args(args.hosts, args.hostfile)
    rsh = args.rsh
    if hosts is None and backend != "mpi" and (args.nnodes or 1) <= 1 and not (args.master or args.node_rank):
        hosts, rsh = slurm_hosts(rsh)  # a Slurm allocation of several nodes: its nodes, through srun
    if hosts is not None and rsh == args.rsh:
        rsh = ssh_rsh(args, rsh)  # horovodrun's -p/-i: ssh's port and identity (not srun's)
    if args.rsh is not None and hosts is None:
        raise LaunchError(f"phalanx run --rsh {args.rsh!r}: it starts ranks on other hosts; give them with "
                          "--hosts h0:2,h1:2 or --hostfile FILE.")
    if args.secret_file is not None and hosts is not None:
        raise LaunchError(f"phalanx run --secret-file {args.secret_file}: with --hosts (or a Slurm allocation) "
                          "phalanx makes a fresh secret for every job and hands it to each host; drop "
                          "--secret-file (it is for --nnodes, one command per host).")
    n = job_ranks(args.n, hosts, backend, oversubscribe=args.oversubscribe,
                  flag="--hostfile" if args.hostfile else "--hosts" if args.hosts else "(in a Slurm allocation)")
    return Launch(n=n, backend=backend, target=target, log_dir=args.log_dir, echo=args.echo,
                  timeout=args.timeout, mpiexec=args.mpiexec, mpi_args=mpi_args, start_timeout=args.start_timeout,
                  max_restarts=args.max_restarts, min_ranks=args.min_ranks, nnodes=args.nnodes,
                  node_rank=args.node_rank, master=args.master, iface=args.iface, secret_file=args.secret_file,
                  hosts=hosts, rsh=rsh, oversubscribe=args.oversubscribe, env=job_env(args))
