"""`phalanx run --backend mpi` across hosts: `--hosts`, `--hostfile`, `--rsh`, `--iface`, a Slurm allocation.

The command translation is checked for both MPI flavours without hosts. The jobs run on two
simulated hosts (`phalanx.testing.simulated_hosts`, one per module): `phalanx run` is started
inside host h0, its ranks reach h1 through the ssh stand-in (`--rsh`), under MPICH (this
virtual environment) and under Open MPI (`/work/main/.venv-ompi`-style environment beside it,
skipped when absent). Every job is bounded by a timeout, and after each one no process may be
left on either host.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers import requires_hosts
from phalanx.launch import Launch
from phalanx.launch._mpi_flavor import find_mpiexec
from phalanx.launch._mpi_hosts import host_args
from phalanx.launch._mpiexec import mpi_command

VENV = Path(sys.executable).parent.parent
OMPI = Path(os.environ.get("PHALANX_OMPI_VENV", str(VENV.parent / ".venv-ompi")))
FLAVOURS = [
    pytest.param(VENV, id="mpich"),
    pytest.param(OMPI, id="openmpi", marks=pytest.mark.skipif(
        not (OMPI / "bin" / "phalanx").exists(), reason=f"no Open MPI environment at {OMPI}")),
]
JOB_TIMEOUT = 90  # seconds; every job here ends within a few

JOB = """\
import os, socket, sys
import numpy as np
import phalanx
phalanx.init()
total = phalanx.allreduce(np.array([phalanx.rank() + 1.0]))[0]
sys.stdout.write(f"rank {phalanx.rank()} of {phalanx.size()} on {socket.gethostname()} sum {total:g} "
                 f"iface {os.environ.get('PHALANX_IFACE', '-')}\\n")  # one write: ranks' lines never mix
sys.stdout.flush()
if len(sys.argv) > 2 and phalanx.rank() == int(sys.argv[2]):
    if sys.argv[1] == "raise":
        raise ValueError(f"boom on rank {phalanx.rank()} ({socket.gethostname()})")
    os.kill(os.getpid(), 9)
phalanx.barrier()
phalanx.shutdown()
"""


RAISE_LINE = next(i for i, line in enumerate(JOB.splitlines(), 1) if "raise ValueError" in line)


# --- the command each flavour gets (no hosts needed) ----------------------------------------------

def _job(**kw: Any) -> Launch:
    return Launch(**{"n": 4, "backend": "mpi", "target": ["train.py"], **kw})


def test_mpich_gets_hosts_ssh_launcher_rsh_and_interface(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "UCX_", "FI_", "PHALANX_IFACE"))}
    job = _job(hosts="h0:2,h1:2", rsh="ssh -p 2222", iface="eth1")
    cmd, own_cleanup = mpi_command(job, env, str(tmp_path))
    wrapper = str(tmp_path / "rsh")
    assert cmd[:2] == [find_mpiexec(), "-n"] and cmd[2] == "4"
    assert cmd[3:11] == ["-hosts", "h0:2,h1:2", "-launcher", "ssh", "-launcher-exec", wrapper, "-iface", "eth1"]
    assert Path(wrapper).read_text() == "#!/bin/sh\nexec ssh -p 2222 \"$@\"\n"  # Hydra takes one program
    assert not own_cleanup  # Hydra's own clean-up: the launcher cannot watch ranks on other hosts
    assert env["PHALANX_IFACE"] == env["FI_TCP_IFACE"] == env["UCX_NET_DEVICES"] == "eth1"
    assert env["PHALANX_LAUNCH_HOST"]  # ranks elsewhere report through stderr
    assert "OMPI_MCA_btl" not in env  # no loopback confinement across hosts


def test_open_mpi_gets_host_rsh_agent_prefix_interface_and_oversubscribe(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "prted").touch()  # a pip install: the daemon beside mpiexec
    job = _job(n=6, hosts="h0:2,h1:2", rsh="ssh -p 2222", iface="eth1", oversubscribe=True)
    env: dict[str, str] = {}
    ours: list[str] = []
    args = host_args(job, "openmpi", str(venv / "bin" / "mpiexec"), str(tmp_path), env, ours)
    assert args == ["--host", "h0:2,h1:2", "--mca", "plm_rsh_agent", "ssh -p 2222", "--prefix", str(venv),
                    "--mca", "btl_tcp_if_include", "eth1", "--mca", "oob_tcp_if_include", "eth1"]
    assert {"PHALANX_IFACE", "PHALANX_LAUNCH_HOST"} <= set(ours)  # forwarded with -x


def test_many_hosts_go_into_a_host_file_in_each_flavours_format(tmp_path: Path) -> None:
    hosts = ",".join(f"n{i}:2" for i in range(20))
    job = _job(n=40, hosts=hosts)
    hydra = host_args(job, "mpich", "/usr/bin/mpiexec", str(tmp_path), {}, [])
    assert hydra[:2] == ["-f", str(tmp_path / "hostfile")] and hydra[2:] == ["-launcher", "ssh"]
    assert (tmp_path / "hostfile").read_text().splitlines()[:2] == ["n0:2", "n1:2"]
    ompi = host_args(job, "openmpi", "/usr/bin/mpiexec", str(tmp_path), {}, [])
    assert ompi == ["--hostfile", str(tmp_path / "hostfile")]
    assert (tmp_path / "hostfile").read_text().splitlines()[:2] == ["n0 slots=2", "n1 slots=2"]


def test_mpich_in_a_slurm_allocation_gets_its_nodes_and_the_slurm_launcher(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[01-02]")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2(x2)")
    assert host_args(_job(), "mpich", "/usr/bin/mpiexec", str(tmp_path), {}, []) == \
        ["-hosts", "node01:2,node02:2", "-launcher", "slurm"]  # pip's Hydra does not read the allocation
    assert host_args(_job(), "openmpi", "/usr/bin/mpiexec", str(tmp_path), {}, []) == []  # Open MPI reads it


# --- jobs on two simulated hosts ------------------------------------------------------------------

@pytest.fixture(scope="module")
def hosts() -> Iterator[Any]:
    from phalanx.testing import simulated_hosts

    with simulated_hosts(2) as made:
        yield made


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mpi-hosts")
    (path / "job.py").write_text(JOB)
    return path


def run_on_h0(hosts: Any, venv: Path, args: list[str], cwd: Path, env: dict[str, str] | None = None) -> Any:
    """`phalanx run ARGS` started inside host h0, bounded; then no process may be left on either host."""
    start = time.monotonic()
    out = hosts.run(0, [str(venv / "bin" / "phalanx"), "run", *args], capture_output=True, text=True,
                    timeout=JOB_TIMEOUT, cwd=str(cwd), env=dict(os.environ, **(env or {})))
    out.elapsed = time.monotonic() - start
    deadline = time.monotonic() + 5
    while (hosts.pids(0) or hosts.pids(1)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert hosts.pids(0) == [] and hosts.pids(1) == [], (hosts.pids(0), hosts.pids(1), out.stderr)
    return out


def ranks_seen(stdout: str) -> dict[int, tuple[str, float, str]]:
    """rank -> (host, allreduce sum, PHALANX_IFACE) from the job's lines."""
    return {int(r): (h, float(s), i) for r, h, s, i in
            re.findall(r"rank (\d+) of \d+ on (\S+) sum (\S+) iface (\S+)", stdout)}


@requires_hosts
@pytest.mark.parametrize("venv", FLAVOURS)
def test_hosts_flag_places_ranks_on_their_hosts(hosts: Any, workdir: Path, venv: Path) -> None:
    out = run_on_h0(hosts, venv, ["--hosts", "h0:2,h1:2", "--rsh", hosts.rsh, "--backend", "mpi",
                                  "--iface", "eth0", "job.py"], workdir)
    assert out.returncode == 0, out.stderr
    assert ranks_seen(out.stdout) == {0: ("h0", 10, "eth0"), 1: ("h0", 10, "eth0"),  # -n: the 4 slots
                                      2: ("h1", 10, "eth0"), 3: ("h1", 10, "eth0")}
    assert "@phalanx" not in out.stdout + out.stderr


RING_JOB = """\
import json, os, sys
os.environ["PHALANX_TEST_RING_LEVELS"] = sys.argv[1]  # argv, not the environment: Open MPI forwards little
sys.path.insert(0, {tests!r})
import phalanx
phalanx.init()
import worlds_ring
sys.stdout.write("RING " + json.dumps([phalanx.rank(), worlds_ring.ring()]) + "\\n")
sys.stdout.flush()
phalanx.shutdown()
"""


@requires_hosts
@pytest.mark.parametrize("venv,layout,levels", [
    pytest.param(*FLAVOURS[0].values, "h0:2,h1:2", "1", id="mpich-2x2-two-levels"),
    pytest.param(*FLAVOURS[0].values, "h0:2,h1:1", "1", id="mpich-2+1-two-levels"),
    pytest.param(*FLAVOURS[0].values, "h0:1,h1:1", "0", id="mpich-1x1-flat"),
    # Open MPI: the one layout with both levels and a ring of two hosts (the ring is phalanx's own code)
    pytest.param(*FLAVOURS[1].values, "h0:2,h1:2", "1", id="openmpi-2x2-two-levels", marks=FLAVOURS[1].marks)])
def test_the_ring_across_hosts_is_two_levels_where_a_host_holds_several_ranks(
        hosts: Any, workdir: Path, venv: Path, layout: str, levels: str) -> None:
    """Every behaviour of ``test_mpi_ring.py`` (every op and dtype against NumPy, handles in any order, the
    gradient engine) on the default ring across two hosts: in two levels (``comm/_hring.py``) where a host
    holds several ranks, the flat ring where each holds one."""
    (workdir / "ring_job.py").write_text(RING_JOB.format(tests=str(Path(__file__).resolve().parent)))
    out = run_on_h0(hosts, venv, ["--hosts", layout, "--rsh", hosts.rsh, "--backend", "mpi", "--timeout", "30",
                                  "ring_job.py", levels], workdir)
    assert out.returncode == 0, out.stdout + out.stderr
    reports = dict(json.loads(line[5:]) for line in out.stdout.splitlines() if line.startswith("RING "))
    assert sorted(reports) == list(range(sum(int(h.split(":")[1]) for h in layout.split(",")))), out.stdout
    failed = {(rank, name): error for rank, report in reports.items() for name, error in report.items() if error}
    assert not failed, failed


@requires_hosts
@pytest.mark.parametrize("venv", FLAVOURS)
def test_hostfile_and_oversubscribe(hosts: Any, workdir: Path, venv: Path) -> None:
    (workdir / "hosts.txt").write_text("# two hosts\nh0 slots=2\nh1:2   # MPICH's form\n")
    out = run_on_h0(hosts, venv, ["--hostfile", "hosts.txt", "--rsh", hosts.rsh, "--backend", "mpi", "-n", "3",
                                  "job.py"], workdir)
    assert out.returncode == 0, out.stderr
    assert ranks_seen(out.stdout) == {0: ("h0", 6, "-"), 1: ("h0", 6, "-"), 2: ("h1", 6, "-")}
    out = run_on_h0(hosts, venv, ["--hostfile", "hosts.txt", "--rsh", hosts.rsh, "--backend", "mpi", "-n", "6",
                                  "--oversubscribe", "job.py"], workdir)
    assert out.returncode == 0, out.stderr
    seen = ranks_seen(out.stdout)
    assert sorted(seen) == list(range(6)) and {s for _, s, _ in seen.values()} == {21}
    assert {host for host, _, _ in seen.values()} == {"h0", "h1"}  # extra ranks: where each MPI puts them


@requires_hosts
@pytest.mark.parametrize("venv", FLAVOURS)
def test_a_rank_raising_on_h1_ends_the_job_and_is_named_with_its_host(hosts: Any, workdir: Path,
                                                                      venv: Path) -> None:
    out = run_on_h0(hosts, venv, ["--hosts", "h0:2,h1:2", "--rsh", hosts.rsh, "--backend", "mpi",
                                  "job.py", "raise", "3"], workdir)
    assert out.returncode == 1, out.stderr
    assert out.elapsed < 30, f"the job took {out.elapsed:.1f} s to end"
    report = out.stderr[out.stderr.index("phalanx run: rank"):]
    assert report.startswith("phalanx run: rank 3 on h1 failed first after "), out.stderr
    assert "ValueError: boom on rank 3 (h1)" in report and f'File "job.py", line {RAISE_LINE}' in report
    assert "@phalanx" not in out.stderr  # the record's line is for the launcher only


@requires_hosts
@pytest.mark.parametrize("venv", FLAVOURS)
def test_a_rank_killed_on_h1_ends_the_job(hosts: Any, workdir: Path, venv: Path) -> None:
    out = run_on_h0(hosts, venv, ["--hosts", "h0:2,h1:2", "--rsh", hosts.rsh, "--backend", "mpi",
                                  "job.py", "kill", "3"], workdir)
    assert out.returncode != 0, out.stderr
    assert out.elapsed < 30, f"the job took {out.elapsed:.1f} s to end"
    if venv == VENV:  # Hydra names the process it saw killed ("PID ... RUNNING AT h1"): the launcher maps it
        assert out.returncode == 137, out.stderr
        assert "phalanx run: rank 3 on h1 failed first: killed by signal 9 (SIGKILL)" in out.stderr, out.stderr
    else:  # Open MPI reports the rank whose connection to it broke first, and aborts; not the killed one
        assert re.search(r"phalanx run: rank \d+ (on h\d )?failed first", out.stderr), out.stderr


@requires_hosts
def test_bad_host_lists_are_refused(hosts: Any, workdir: Path) -> None:
    (workdir / "empty.txt").write_text("# nobody\n")
    cases = [
        (["--hosts", ""], "--hosts: got an empty host list"),
        (["--hostfile", "empty.txt"], "the file lists no host"),
        (["--hosts", "h0:2,h1,h0"], "host 'h0' is listed more than once (h0:2,h1:1,h0:1); list each host once "
                                    "with all its slots, e.g. h0:3"),
        (["--hosts", "h0,h9"], "unknown host name 'h9' (does not resolve here)"),
        (["--hosts", "h0:2,h1:2", "-n", "5"], "5 ranks but only 4 slots (h0:2,h1:2); give -n 4 or less, more "
                                              "slots, or --oversubscribe"),
        (["--hosts", "h0:x"], "bad slot count 'x'"),
        (["--rsh", "ssh"], "--rsh 'ssh': it starts ranks on other hosts; give them with --hosts"),
    ]
    for args, message in cases:
        out = run_on_h0(hosts, VENV, [*args, "--backend", "mpi", "job.py"], workdir)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)


# --- a Slurm allocation, with a stand-in srun -----------------------------------------------------

SRUN = """\
#!{python}
# A stand-in for Slurm's `srun` inside an allocation of the simulated hosts. It emulates what
# mpiexec asks of it: `srun --version`; and `srun [--nodelist A,B | -w A,B] [-N k] [-n k |
# --ntasks=k] [--ntasks-per-node=k] [other options, ignored] CMD...` starts the tasks on the nodes
# (default: SLURM_JOB_NODELIST), one node after the other, through the ssh stand-in, with the
# caller's environment (srun's --export=ALL) plus SLURM_PROCID, SLURM_NODEID, SLURM_LOCALID,
# SLURM_STEP_NUM_TASKS, SLURM_STEP_NUM_NODES and SLURM_STEP_NODELIST, from the caller's directory;
# it waits for them all and exits with the first non-zero status; SIGTERM/SIGINT end every task.
import os, shlex, signal, subprocess, sys
RSH = {rsh!r}
argv = sys.argv[1:]
if argv[:1] == ["--version"]:
    print("slurm 23.02.7 (stand-in)"); sys.exit(0)
opts = {{}}
while argv and argv[0].startswith("-"):
    key, eq, value = argv.pop(0).partition("=")
    if key in ("--nodelist", "-w", "-N", "--nodes", "-n", "--ntasks", "--ntasks-per-node", "--input") and not eq:
        value = argv.pop(0)
    opts[key] = value
nodes = (opts.get("--nodelist") or opts.get("-w") or os.environ["SLURM_JOB_NODELIST_EXPANDED"]).split(",")
nodes = nodes[:int(opts.get("-N") or opts.get("--nodes") or len(nodes))]
ntasks = int(opts.get("-n") or opts.get("--ntasks") or len(nodes) * int(opts.get("--ntasks-per-node", 1)))
per_node = -(-ntasks // len(nodes))
env = {{k: v for k, v in os.environ.items() if k not in ("PWD", "OLDPWD", "SHLVL", "_")}}
procs = []
for task in range(ntasks):
    node = task // per_node
    env.update(SLURM_PROCID=str(task), SLURM_NODEID=str(node), SLURM_LOCALID=str(task % per_node),
               SLURM_STEP_NUM_TASKS=str(ntasks), SLURM_STEP_NUM_NODES=str(len(nodes)),
               SLURM_STEP_NODELIST=",".join(nodes))
    words = ["cd", shlex.quote(os.getcwd()), "&&", "exec", "env"]
    words += [shlex.quote(f"{{k}}={{v}}") for k, v in env.items()] + [shlex.quote(w) for w in argv]
    procs.append(subprocess.Popen([RSH, nodes[node], *words], stdin=subprocess.DEVNULL))
def stop(*_):
    for p in procs:
        p.terminate()
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
codes = [p.wait() for p in procs]
sys.exit(next((c for c in codes if c), 0))
"""


@requires_hosts
@pytest.mark.parametrize("venv", FLAVOURS)
def test_inside_a_slurm_allocation_the_job_takes_its_nodes_and_task_count(hosts: Any, workdir: Path,
                                                                          venv: Path) -> None:
    bin_dir = workdir / "slurm-bin"
    bin_dir.mkdir(exist_ok=True)
    srun = bin_dir / "srun"
    srun.write_text(SRUN.format(python=sys.executable, rsh=hosts.rsh))
    srun.chmod(0o755)
    allocation = {"SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242", "SLURM_NTASKS": "3", "SLURM_NPROCS": "3",
                  "SLURM_JOB_NODELIST": "h[0-1]", "SLURM_NODELIST": "h[0-1]", "SLURM_NNODES": "2",
                  "SLURM_JOB_NUM_NODES": "2", "SLURM_TASKS_PER_NODE": "2,1", "SLURM_JOB_CPUS_PER_NODE": "2,1",
                  "SLURM_JOB_NODELIST_EXPANDED": "h0,h1",  # for the stand-in only
                  "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    out = run_on_h0(hosts, venv, ["--backend", "mpi", "job.py"], workdir, env=allocation)
    assert out.returncode == 0, out.stdout + out.stderr
    assert ranks_seen(out.stdout) == {0: ("h0", 6, "-"), 1: ("h0", 6, "-"), 2: ("h1", 6, "-")}  # -n: SLURM_NTASKS
