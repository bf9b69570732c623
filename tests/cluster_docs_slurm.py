"""Stand-ins for Slurm's ``sbatch`` and ``srun`` on simulated hosts, for tests/test_cluster_docs.py.

``python cluster_docs_slurm.py CONFIG sbatch|srun ARGS...`` (through the wrapper scripts
:func:`install` writes) emulates what a program inside a Slurm job can see, and nothing more:

* ``sbatch [OPTIONS] SCRIPT``: an allocation of the first ``--nodes`` hosts of CONFIG (each
  ``--ntasks-per-node`` tasks, or ``--ntasks`` spread in blocks), from the options and the
  script's ``#SBATCH`` lines; it prints ``Submitted batch job ID``, runs SCRIPT with ``bash`` on
  the first node (through the hosts' ssh stand-in) with the submitting environment plus the
  variables Slurm sets in a batch job (``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST``/``SLURM_NODELIST``
  compressed as ``h[0-1]``, ``SLURM_NNODES``, ``SLURM_NTASKS``, ``SLURM_TASKS_PER_NODE``
  as ``2(x2)``, ``SLURM_NODEID``/``SLURM_PROCID``/``SLURM_LOCALID`` 0, ``SLURMD_NODENAME``,
  ``SLURM_SUBMIT_DIR``, ...), writes its output to ``slurm-ID.out`` (or ``--output``) and, unlike
  a real ``sbatch``, waits for it and exits with its status (as ``sbatch --wait`` does).
* ``srun [OPTIONS] COMMAND...`` inside such an allocation: a job step of ``--ntasks`` tasks
  (default: the allocation's) on ``--nodes``/``--nodelist`` nodes (default: all), in blocks; each
  task runs on its node through the ssh stand-in, with the caller's environment plus the step's
  variables (``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_STEP_*``, and
  ``SLURM_NTASKS``/``SLURM_NNODES``/``SLURM_NODELIST``/``SLURM_TASKS_PER_NODE`` of the step),
  stdin from ``/dev/null`` (with ``--input all`` and one task: srun's stdin, whose end also ends
  the task, since the stand-in cannot tell it from srun going away), output relayed; it waits for every task and exits with the largest
  status. When srun is signalled or exits, every task still running is terminated (as
  slurmstepd does).

Not emulated: PMI/PMIx (so ``srun python train.py`` cannot start an MPI job here), cgroups,
CPU binding, accounting, queueing. The environment travels in a file (mode 600) that the task
reads and deletes, so nothing of it is on a command line.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading

USAGE = "usage: cluster_docs_slurm.py CONFIG (sbatch|srun|task) ARGS..."
_VALUED = {"-N": "nodes", "--nodes": "nodes", "-n": "ntasks", "--ntasks": "ntasks",
           "--ntasks-per-node": "ntasks_per_node", "-w": "nodelist", "--nodelist": "nodelist",
           "-J": "job_name", "--job-name": "job_name", "-o": "output", "--output": "output",
           "-e": "error", "--error": "error", "-t": "time", "--time": "time", "--input": "input",
           "--gpus-per-node": "gpus", "--gres": "gres", "-c": "cpus", "--cpus-per-task": "cpus",
           "--mem": "mem", "-p": "partition", "--partition": "partition", "--cpu-bind": "cpu_bind",
           "--mpi": "mpi", "--export": "export", "--kill-on-bad-exit": "kill", "-K": "kill"}
_FLAGS = {"--kill-on-bad-exit", "-K", "--external-launcher", "--exclusive", "--overlap", "--wait", "-W", "--no-kill", "-l", "--label"}


def install(bin_dir: str, hosts: list[str], rsh: str) -> None:
    """Write ``sbatch`` and ``srun`` into ``bin_dir``: stand-ins for a cluster of ``hosts`` reached by ``rsh``."""
    config = os.path.join(bin_dir, "slurm-standin.json")
    with open(config, "w") as f:
        json.dump({"hosts": hosts, "rsh": rsh, "python": sys.executable}, f)
    for name in ("sbatch", "srun"):
        path = os.path.join(bin_dir, name)
        with open(path, "w") as f:
            f.write(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(os.path.abspath(__file__))} "
                    f"{shlex.quote(config)} {name} \"$@\"\n")
        os.chmod(path, 0o755)


def parse(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """(options by name, the rest) of an sbatch/srun command line; unknown options are an error."""
    opts: dict[str, str] = {}
    i = 0
    while i < len(args) and args[i].startswith("-"):
        arg, i = args[i], i + 1
        name, eq, value = arg.partition("=") if arg.startswith("--") else (arg[:2], bool(arg[2:]), arg[2:])
        if name in _FLAGS and not eq:
            opts[name.lstrip("-")] = "1"
        elif name in _VALUED:
            if not eq:
                value, i = args[i], i + 1
            opts[_VALUED[name]] = value
        else:
            sys.exit(f"slurm stand-in: unknown option {arg!r} (add it to tests/cluster_docs_slurm.py)")
    return opts, args[i:]


def compress(names: list[str]) -> str:
    """Slurm's compressed node list: ``h0,h1,h3`` -> ``h[0-1,3]``."""
    groups: dict[str, list[int]] = {}
    for name in names:
        match = re.fullmatch(r"(.*?)(\d+)", name)
        prefix, number = (match.group(1), int(match.group(2))) if match else (name, -1)
        groups.setdefault(prefix, []).append(number)
    parts = []
    for prefix, numbers in groups.items():
        if numbers == [-1]:
            parts.append(prefix)
            continue
        ranges, start = [], numbers[0]
        for a, b in zip(numbers, numbers[1:] + [None], strict=True):
            if b != a + 1:
                ranges.append(f"{start}" if start == a else f"{start}-{a}")
                start = b
        parts.append(f"{prefix}{ranges[0]}" if len(numbers) == 1 else f"{prefix}[{','.join(ranges)}]")
    return ",".join(parts)


def expand(nodelist: str) -> list[str]:
    """The names of a compressed node list of one bracket group per name: ``h[0-1,3],x`` -> ``h0 h1 h3 x``."""
    names = []
    for prefix, group, plain in re.findall(r"([^,\[]+)\[([^\]]*)\]|([^,\[\]]+)", nodelist):
        if plain:
            names.append(plain)
            continue
        for item in group.split(","):
            low, _, high = item.partition("-")
            names += [f"{prefix}{i:0{len(low)}d}" for i in range(int(low), int(high or low) + 1)]
    return names


def expand_counts(text: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` read back: ``2(x2),1`` -> ``[2, 2, 1]``."""
    found = re.findall(r"(\d+)(?:\(x(\d+)\))?", text)
    return [int(n) for n, times in found for _ in range(int(times or 1))]


def counts(text: list[int]) -> str:
    """Slurm's ``SLURM_TASKS_PER_NODE``: ``[2, 2, 1]`` -> ``2(x2),1``."""
    out: list[str] = []
    for value in text:
        if out and out[-1].split("(")[0] == str(value):
            head, _, times = out[-1].partition("(x")
            out[-1] = f"{head}(x{int(times.rstrip(')') or 1) + 1})"
        else:
            out.append(str(value))
    return ",".join(out)


def spread(ntasks: int, nodes: int) -> list[int]:
    """Tasks per node, Slurm's block distribution: the first ``ntasks % nodes`` nodes take one more."""
    return [ntasks // nodes + (i < ntasks % nodes) for i in range(nodes)]


def start_task(config: dict[str, object], node: str, env: dict[str, str], argv: list[str],
               relay: bool = False, **kw: object) -> subprocess.Popen[bytes]:
    """Run ``argv`` on ``node`` through the ssh stand-in, with ``env`` and the current directory
    (``relay``: the task reads this process's stdin)."""
    fd, path = tempfile.mkstemp(prefix="slurm-task-", suffix=".json", dir=os.environ.get("SLURM_STANDIN_DIR"))
    with os.fdopen(fd, "w") as f:
        json.dump({"env": env, "cwd": os.getcwd(), "argv": argv, "relay": relay}, f)
    remote = shlex.join([str(config["python"]), os.path.abspath(__file__), "-", "task", path])
    return subprocess.Popen([str(config["rsh"]), node, remote], stdin=None if relay else subprocess.PIPE,
                            start_new_session=True, **kw)  # type: ignore[call-overload]


def task(path: str) -> int:
    """On the node: read and delete the task file, run the task, end it when our stdin closes."""
    with open(path) as f:
        spec = json.load(f)
    os.unlink(path)
    os.chdir(spec["cwd"])
    relay = spec.get("relay", False)
    proc = subprocess.Popen(spec["argv"], env=spec["env"], stdin=subprocess.PIPE if relay else subprocess.DEVNULL,
                            start_new_session=True)

    def watch() -> None:
        while data := os.read(0, 1 << 16):  # until EOF: srun is gone or ended the step
            if relay and proc.stdin is not None:
                try:
                    proc.stdin.write(data)
                    proc.stdin.flush()
                except OSError:
                    pass
        if relay and proc.stdin is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
        if proc.poll() is None:
            stop([proc])

    threading.Thread(target=watch, daemon=True).start()
    code = proc.wait()
    return code if code >= 0 else 128 - code


def stop(procs: list[subprocess.Popen[bytes]], grace: float = 3.0) -> None:
    """SIGTERM every process group still running, SIGKILL after ``grace`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
        for proc in procs:
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass


def srun(config: dict[str, object], args: list[str]) -> int:
    opts, argv = parse(args)
    if "SLURM_JOB_ID" not in os.environ or not argv:
        sys.exit("srun stand-in: only inside an sbatch stand-in allocation, with a command")
    alloc = expand(os.environ["SLURM_JOB_NODELIST"])
    nodes = opts["nodelist"].split(",") if "nodelist" in opts else alloc[:int(opts.get("nodes", len(alloc)))]
    if "ntasks_per_node" in opts:
        per_node = [int(opts["ntasks_per_node"])] * len(nodes)
    elif "ntasks" in opts:
        per_node = spread(int(opts["ntasks"]), len(nodes))
    elif "nodes" in opts or "nodelist" in opts:
        per_node = [1] * len(nodes)
    else:
        per_node = expand_counts(os.environ["SLURM_TASKS_PER_NODE"])
    ntasks, step = sum(per_node), {"SLURM_STEP_ID": "0", "SLURM_STEPID": "0"}
    step.update(SLURM_STEP_NODELIST=compress(nodes), SLURM_NODELIST=compress(nodes),
                SLURM_STEP_NUM_NODES=str(len(nodes)), SLURM_NNODES=str(len(nodes)),
                SLURM_STEP_NUM_TASKS=str(ntasks), SLURM_NTASKS=str(ntasks), SLURM_NPROCS=str(ntasks),
                SLURM_STEP_TASKS_PER_NODE=counts(per_node), SLURM_TASKS_PER_NODE=counts(per_node))
    relay = opts.get("input") == "all"
    if relay and ntasks != 1:
        sys.exit("srun stand-in: --input all is emulated for a step of one task only")
    procs, rank = [], 0
    signal.signal(signal.SIGTERM, lambda *_: stop(procs) or sys.exit(143))
    signal.signal(signal.SIGINT, lambda *_: stop(procs) or sys.exit(130))
    for node_id, (node, count) in enumerate(zip(nodes, per_node, strict=True)):
        for local in range(count):
            env = dict(os.environ, **step, SLURM_PROCID=str(rank), SLURM_LOCALID=str(local),
                       SLURM_NODEID=str(node_id), SLURMD_NODENAME=node,
                       SLURM_GTIDS=",".join(str(r) for r in range(rank - local, rank - local + count)))
            procs.append(start_task(config, node, env, argv, relay=relay))
            rank += 1
    codes = [p.wait() for p in procs]
    stop(procs)
    return max(codes)


def sbatch(config: dict[str, object], args: list[str]) -> int:
    opts, rest = parse(args)
    if not rest:
        sys.exit("sbatch stand-in: give a batch script")
    script = rest[0]
    with open(script) as f:
        directives = [line[len("#SBATCH"):].split("#")[0].split() for line in f if line.startswith("#SBATCH")]
    opts = {**parse([w for words in directives for w in words])[0], **opts}
    hosts = list(config["hosts"])  # type: ignore[call-overload]
    if "ntasks_per_node" in opts:
        nodes = int(opts.get("nodes", 1))
        per_node = [int(opts["ntasks_per_node"])] * nodes
    else:
        nodes = int(opts.get("nodes", 1))
        per_node = spread(int(opts.get("ntasks", nodes)), nodes)
    if nodes > len(hosts):
        sys.exit(f"sbatch stand-in: {nodes} nodes asked for, {len(hosts)} hosts exist")
    names, job_id = hosts[:nodes], str(1000 + os.getpid() % 9000)
    env = dict(os.environ, SLURM_JOB_ID=job_id, SLURM_JOBID=job_id, SLURM_JOB_NAME=opts.get("job_name", script),
               SLURM_JOB_NODELIST=compress(names), SLURM_NODELIST=compress(names), SLURM_JOB_NUM_NODES=str(nodes),
               SLURM_NNODES=str(nodes), SLURM_NTASKS=str(sum(per_node)), SLURM_NPROCS=str(sum(per_node)),
               SLURM_TASKS_PER_NODE=counts(per_node), SLURM_JOB_CPUS_PER_NODE=counts(per_node),
               SLURM_CPUS_ON_NODE=str(per_node[0]), SLURM_NODEID="0", SLURM_PROCID="0", SLURM_LOCALID="0",
               SLURMD_NODENAME=names[0], SLURM_SUBMIT_DIR=os.getcwd(), SLURM_SUBMIT_HOST=os.uname().nodename,
               SLURM_CLUSTER_NAME="standin")
    if "ntasks_per_node" in opts:
        env["SLURM_NTASKS_PER_NODE"] = opts["ntasks_per_node"]
    output = opts.get("output", "slurm-%j.out").replace("%j", job_id)
    print(f"Submitted batch job {job_id}", flush=True)
    with open(output, "wb") as out:
        proc = start_task(config, names[0], env, ["bash", os.path.abspath(script)], stdout=out,
                          stderr=subprocess.STDOUT)
        return proc.wait()


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        sys.exit(USAGE)
    if argv[1] == "task":
        os._exit(task(argv[2]))  # not waiting for the thread that reads stdin
    if argv[1:3] == ["srun", "--version"]:  # Open MPI asks before it uses srun
        print("slurm 23.11.0 (stand-in)")
        return 0
    with open(argv[0]) as f:
        config = json.load(f)
    if os.environ.get("SLURM_STANDIN_LOG"):
        with open(os.environ["SLURM_STANDIN_LOG"], "a") as log:
            log.write(shlex.join(argv[1:]) + "\n")
    return {"sbatch": sbatch, "srun": srun}[argv[1]](config, argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
