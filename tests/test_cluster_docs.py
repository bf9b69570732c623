"""Every command of docs/cluster.md runs, as written, on simulated hosts (or is exempt, with the reason).

The link between the guide and this file is mechanical. Each fenced block of the
guide is preceded by ``<!-- block: NAME -->`` (commands) or ``<!-- file: NAME -->``
(a file the commands use, written into each job's directory);
:func:`test_every_block_of_the_guide_is_run_or_exempt` fails when a block has no
marker, when a command block is neither run here (a call of :func:`block` with its name)
nor in :data:`EXEMPT`, or when this file names a block the guide no longer has.

How a block runs: its text goes to ``bash -c`` on host ``h0`` of two simulated hosts
(``h0``, ``h1``: ``eth0`` at 198.18.0.1 and .2), in a fresh directory holding the
guide's files, with ``PATH`` starting with stand-ins: ``ssh`` (the hosts' ssh
stand-in, so ``--hosts`` and ``--rsh`` reach the other host), and ``sbatch``/``srun``
(``tests/cluster_docs_slurm.py``: a batch script and its ``srun`` tasks get the
variables Slurm sets, ``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST``, ``SLURM_NTASKS``,
``SLURM_TASKS_PER_NODE``, ``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NODEID``, ..., and
run on their nodes through the ssh stand-in; no PMI). A block split by ``# on hN:``
lines runs each part on its host at once, after the lines before the first such
line. ``HOME`` is a fresh shared directory. Python blocks run with this Python in
the job's directory. Every run has a hard timeout, and no process may be left on
a host after it.

The MPI blocks run under MPICH (``.venv``) and, where ``.venv-ompi`` exists, Open MPI.
Needs root (``requires_hosts``) except the coverage check. Times are printed with ``-s``.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import cluster_docs_slurm
from conftest import AVAILABLE
from helpers import requires_hosts

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "cluster.md"
VENVS = {"mpich": ROOT / ".venv" / "bin", "openmpi": ROOT / ".venv-ompi" / "bin"}
JOB_TIMEOUT = 90  # seconds any one block may run here
LEFT_BOUND = 10.0  # seconds after a block ends by which no process may be left on a host
PARTITION_GRACE = 20.0  # the simulated-partition block: every launcher ends within --timeout (10 s) plus this

# Command blocks of the guide that no test here runs, and why.
EXEMPT = {
    "ssh-keys": "real ssh: makes a key and installs it on real hosts (the hosts here use an ssh stand-in)",
    "slurm-srun-mpi": "needs Slurm's PMI/PMIx to start MPI ranks, which the srun stand-in does not provide",
    "slurm-nccl": "NCCL: needs GPUs",
    "restarts-in-place": "one host, with kills in the middle of fit(elastic=True): tests/test_recovery.py runs "
                         "this job (tests/program_recovery.py) and checks what the guide says of it",
}

_MARKED = re.compile(r"<!-- (block|file): ([\w.\-]+) -->\n```(\w+)\n(.*?)^```", re.S | re.M)
_FENCE = re.compile(r"^```\w*\n", re.M)
_HOST_PART = re.compile(r"^# on (h\d+):\s*$", re.M)


@dataclass
class Block:
    kind: str  # "block" (commands) or "file"
    name: str
    lang: str
    text: str


def guide() -> dict[str, Block]:
    """The guide's marked blocks by name."""
    text = GUIDE.read_text()
    return {m.group(2): Block(m.group(1), m.group(2), m.group(3), m.group(4)) for m in _MARKED.finditer(text)}


def block(name: str) -> Block:
    """The command block ``name`` of the guide (the coverage check reads these calls in this file)."""
    found = guide()[name]
    assert found.kind == "block", f"{name} is a file of the guide, not a command block"
    return found


def test_every_block_of_the_guide_is_run_or_exempt() -> None:
    text = GUIDE.read_text()
    blocks = guide()
    assert len(_FENCE.findall(text)) == 2 * len(blocks), "a fenced block of docs/cluster.md has no <!-- block/file: --> mark"
    commands = {n for n, b in blocks.items() if b.kind == "block"}
    run_here = set(re.findall(r"\bblock\(\"([\w.\-]+)\"\)", Path(__file__).read_text()))
    assert not run_here & set(EXEMPT), "a block is both run and exempt"
    assert commands - run_here - set(EXEMPT) == set(), "blocks of the guide that no test runs"
    assert (run_here | set(EXEMPT)) - commands == set(), "blocks named here that the guide no longer has"
    assert all(reason.strip() for reason in EXEMPT.values())
    for name in (n for n, b in blocks.items() if b.kind == "file"):
        assert any(name in blocks[c].text for c in commands), f"no command of the guide uses {name}"


# -- running blocks on simulated hosts ----------------------------------------------------------------

@dataclass
class Cluster:
    hosts: object  # phalanx.testing.SimulatedHosts
    bin_dir: Path
    home: Path
    root: Path
    log: Path  # what the Slurm stand-ins were asked to do


@dataclass
class Result:
    code: int | None  # None: timed out
    out: str
    seconds: float
    workdir: Path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    from phalanx.testing import simulated_hosts

    root = tmp_path_factory.mktemp("cluster_docs")
    bin_dir, home = root / "bin", root / "home"
    bin_dir.mkdir()
    home.mkdir()
    with simulated_hosts(2) as hosts:
        ssh = bin_dir / "ssh"
        ssh.write_text(f"#!/bin/sh\nexec {hosts.rsh} \"$@\"\n")
        ssh.chmod(0o755)
        cluster_docs_slurm.install(str(bin_dir), hosts.names, hosts.rsh)
        yield Cluster(hosts, bin_dir, home, root, root / "slurm.log")


def _env(cluster: Cluster, venv: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "PHALANX_", "MASTER_", "GLOO_", "NCCL_")) and k not in ("RANK", "WORLD_SIZE")}
    env.update(PATH=f"{cluster.bin_dir}:{VENVS[venv]}:{os.environ['PATH']}", HOME=str(cluster.home),
               OMP_NUM_THREADS="1", SLURM_STANDIN_LOG=str(cluster.log), VIRTUAL_ENV=str(VENVS[venv].parent))
    return env


def _workdir(cluster: Cluster, name: str) -> Path:
    """A fresh directory with the guide's files in it."""
    for i in range(100):
        path = cluster.root / f"{name}-{i}"
        if not path.exists():
            break
    path.mkdir()
    for found in guide().values():
        if found.kind == "file":
            (path / found.name).write_text(found.text)
    return path


def _no_process_left(cluster: Cluster) -> dict[int, list[int]]:
    hosts = cluster.hosts
    deadline = time.monotonic() + LEFT_BOUND
    while True:
        left = {i: hosts.pids(i) for i in range(len(hosts)) if hosts.pids(i)}  # type: ignore[arg-type]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def run_block(cluster: Cluster, found: Block, venv: str = "mpich", timeout: float = JOB_TIMEOUT) -> dict[str, Result]:
    """Run ``found`` as the module docstring says; its result per host (``"h0"``, ...)."""
    hosts, env, workdir = cluster.hosts, _env(cluster, venv), _workdir(cluster, found.name)
    parts = _HOST_PART.split(found.text)
    preamble, by_host = parts[0], dict(zip(parts[1::2], parts[2::2], strict=True)) or {"h0": parts[0]}
    if len(parts) > 1 and preamble.strip():
        done = hosts.run(0, ["bash", "-c", preamble], cwd=workdir, env=env, capture_output=True, text=True,  # type: ignore[attr-defined]
                         timeout=30)
        assert done.returncode == 0, done.stdout + done.stderr
    results: dict[str, Result] = {}

    def one(host: str, text: str) -> None:
        start = time.monotonic()
        proc = hosts.popen(int(host[1:]), ["bash", "-c", text], cwd=workdir, env=env,  # type: ignore[attr-defined]
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            for i in range(len(hosts)):  # type: ignore[arg-type]
                hosts.kill(i)  # type: ignore[attr-defined]
            out, code = proc.communicate()[0], None
        results[host] = Result(code, out, time.monotonic() - start, workdir)

    threads = [threading.Thread(target=one, args=item) for item in by_host.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    left = _no_process_left(cluster)
    for host, result in results.items():
        print(f"\n[{found.name} {venv}] {host}: exit {result.code} in {result.seconds:.1f} s")
        assert result.code is not None, f"{found.name} on {host} ran past {timeout} s:\n{result.out}"
    assert not left, f"processes left on the hosts after {found.name}: {left}"
    return results


def ranks(out: str) -> list[tuple[int, int, str]]:
    """(rank, size, host) of every ``[r/n] on hK`` line train.py printed."""
    return sorted((int(r), int(n), h) for r, n, h in re.findall(r"\[(\d+)/(\d+)\] on (h\d+)", out))


def placed(*hosts: str) -> list[tuple[int, int, str]]:
    """What :func:`ranks` finds for one run whose rank r runs on ``hosts[r]``."""
    return [(r, len(hosts), h) for r, h in enumerate(hosts)]


def assert_trained(out: str, *where: list[tuple[int, int, str]]) -> None:
    """``out`` holds the runs ``where`` (one list of :func:`placed` per run), each ending in ``done:``."""
    assert ranks(out) == sorted(r for run in where for r in run), out
    done = re.findall(r"done: (\d+) ranks, (\d+) steps", out)
    assert sorted(int(n) for n, _ in done) == sorted(len(run) for run in where), out
    assert all(steps == "128" for _, steps in done), out  # 4 epochs of 2048 samples, global batch 64


FOUR = placed("h0", "h0", "h1", "h1")


def _venvs() -> list[object]:
    return [pytest.param(v, id=v, marks=pytest.mark.skipif(not (VENVS[v] / "mpiexec").exists(),
                                                         reason=f"no {VENVS[v].parent.name} with {v}'s mpiexec"))
            for v in VENVS]


needs_gloo = pytest.mark.skipif("gloo" not in AVAILABLE, reason="no gloo backend here (torch.distributed)")
needs_mpi = pytest.mark.skipif("mpi" not in AVAILABLE, reason="no mpi backend here (mpi4py and an MPI)")


@requires_hosts
def test_ssh_check_prints_the_environment_of_the_other_host(cluster: Cluster) -> None:
    result = run_block(cluster, block("ssh-check"))["h0"]
    assert result.code == 0 and result.out.strip() == str(VENVS["mpich"].parent), result.out


@requires_hosts
@needs_gloo
@needs_mpi
@pytest.mark.parametrize("venv", _venvs())
def test_hosts_run_mpi_and_gloo_across_two_hosts(cluster: Cluster, venv: str) -> None:
    result = run_block(cluster, block("hosts"), venv)["h0"]
    assert result.code == 0, result.out
    assert_trained(result.out, FOUR, FOUR)


@requires_hosts
@needs_gloo
@needs_mpi
def test_hostfiles_in_both_formats(cluster: Cluster) -> None:
    result = run_block(cluster, block("hostfile"))["h0"]
    assert result.code == 0, result.out
    assert_trained(result.out, FOUR, placed("h0", "h0"))


@requires_hosts
@needs_mpi
def test_rsh_with_arguments(cluster: Cluster) -> None:
    result = run_block(cluster, block("rsh"))["h0"]
    assert result.code == 0, result.out
    assert_trained(result.out, FOUR)


@requires_hosts
@needs_gloo
def test_one_launcher_per_host_with_a_secret_file(cluster: Cluster) -> None:
    results = run_block(cluster, block("nnodes"))
    assert results["h0"].code == 0 and results["h1"].code == 0, results
    assert ranks(results["h0"].out) == FOUR[:2] and ranks(results["h1"].out) == FOUR[2:], results
    assert "done: 4 ranks" in results["h0"].out, results["h0"].out
    assert oct((cluster.home / "job.secret").stat().st_mode & 0o777) == "0o600"


@requires_hosts
@needs_gloo
def test_torchrun_on_two_hosts(cluster: Cluster) -> None:
    results = run_block(cluster, block("torchrun"))
    assert results["h0"].code == 0 and results["h1"].code == 0, results
    assert ranks(results["h0"].out) == FOUR[:2] and ranks(results["h1"].out) == FOUR[2:], results


@requires_hosts
@needs_gloo
@needs_mpi
def test_the_interface_by_flag_and_by_variable(cluster: Cluster) -> None:
    result = run_block(cluster, block("iface"))["h0"]
    assert result.code == 0, result.out
    assert_trained(result.out, FOUR, FOUR)


@requires_hosts
@needs_gloo
def test_a_loopback_interface_is_refused_naming_the_interfaces(cluster: Cluster) -> None:
    secret = cluster.home / "job.secret"
    if not secret.exists():  # made by the nnodes block when it ran first
        secret.write_text(secrets.token_hex(32) + "\n")
    result = run_block(cluster, block("iface-error"), timeout=30)["h0"]
    assert result.code != 0 and result.seconds < 30, result.out
    for said in ("RendezvousError", "PHALANX_IFACE=lo is lo (127.0.0.1), a loopback address", "--iface NAME",
                 "Interfaces here:", "eth0 198.18.0.1"):
        assert said in result.out, (said, result.out)


@requires_hosts
@needs_gloo
def test_a_loopback_interface_given_to_hosts_is_refused_naming_the_interfaces(cluster: Cluster) -> None:
    result = run_block(cluster, block("iface-error-hosts"), timeout=60)["h0"]
    assert result.code != 0, result.out
    for said in ("a loopback address", "--iface NAME", "Interfaces here:", "eth0 198.18.0.1"):
        assert said in result.out, (said, result.out)
    assert result.seconds < 20, f"refused only after {result.seconds:.1f} s (--timeout 20): at init, not in it"


@requires_hosts
@needs_gloo
def test_a_job_on_several_hosts_without_a_secret_is_refused(cluster: Cluster) -> None:
    result = run_block(cluster, block("secret-missing"), timeout=30)["h0"]
    assert result.code not in (0, None), result.out
    for said in ("a job on several hosts needs a secret", "PHALANX_SECRET is not set", "--secret-file"):
        assert said in result.out, (said, result.out)
    assert "[0/" not in result.out, "ranks started without a secret"


def _slurm_output(result: Result) -> str:
    job = re.search(r"Submitted batch job (\d+)", result.out)
    assert result.code == 0 and job, result.out
    return (result.workdir / f"slurm-{job.group(1)}.out").read_text()


def _slurm_calls(cluster: Cluster) -> list[str]:
    calls = cluster.log.read_text().splitlines() if cluster.log.exists() else []
    cluster.log.write_text("")
    return calls


@requires_hosts
@needs_mpi
@pytest.mark.parametrize("venv", _venvs())
def test_slurm_batch_script_with_phalanx_run_mpi(cluster: Cluster, venv: str) -> None:
    _slurm_calls(cluster)
    out = _slurm_output(run_block(cluster, block("slurm-mpi"), venv)["h0"])
    assert_trained(out, FOUR)
    daemon = {"mpich": "hydra_pmi_proxy", "openmpi": "prted"}[venv]  # started by MPI through srun
    assert any(c.startswith("srun ") and daemon in c for c in _slurm_calls(cluster)), "srun was not used"


@requires_hosts
@needs_gloo
def test_slurm_batch_script_with_one_launcher_per_node_gloo(cluster: Cluster) -> None:
    _slurm_calls(cluster)
    out = _slurm_output(run_block(cluster, block("slurm-gloo"))["h0"])
    assert_trained(out, FOUR)
    assert any(c.startswith("srun bash -c") for c in _slurm_calls(cluster)), "srun was not used"


@requires_hosts
@needs_gloo
def test_slurm_batch_script_with_phalanx_run_alone_uses_the_allocation_gloo(cluster: Cluster) -> None:
    _slurm_calls(cluster)
    out = _slurm_output(run_block(cluster, block("slurm-gloo-alloc"))["h0"])
    assert_trained(out, FOUR)
    calls = _slurm_calls(cluster)
    assert any(c.startswith("srun ") and "--nodelist h1" in c and "phalanx.launch._remote" in c for c in calls), calls


@requires_hosts
@needs_mpi
def test_timeouts_example(cluster: Cluster) -> None:
    result = run_block(cluster, block("timeouts"))["h0"]
    assert result.code == 0, result.out
    assert_trained(result.out, FOUR)


@requires_hosts
@needs_mpi
def test_restarts_go_on_without_a_lost_host(cluster: Cluster) -> None:
    hosts = cluster.hosts
    hosts.cut(1)  # type: ignore[attr-defined]  # h1 is lost before the job starts
    try:
        result = run_block(cluster, block("restarts"), timeout=120)["h0"]
    finally:
        hosts.heal(1)  # type: ignore[attr-defined]
    assert result.code == 0, result.out
    assert "host h1 is lost" in result.out and "the new world: 2 ranks on h0:2" in result.out, result.out
    assert_trained(result.out, placed("h0", "h0"))


@requires_hosts
@needs_gloo
@needs_mpi
def test_simulated_partition_ends_every_job_within_the_bound(cluster: Cluster) -> None:
    found, workdir = block("simulated-partition"), _workdir(cluster, "simulated-partition")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", found.text], cwd=workdir, capture_output=True, text=True,
                          timeout=240, env=_env(cluster, "mpich"))
    print(f"\n[simulated-partition] {time.monotonic() - start:.1f} s:\n{done.stdout}")
    assert done.returncode == 0, done.stdout + done.stderr
    ended = dict((b, (int(c), float(s))) for b, c, s in
                 re.findall(r"^(\w+): exit status (-?\d+) ([\d.]+) s after the cut", done.stdout, re.M))
    assert set(ended) == {"mpi", "gloo"}, done.stdout
    for backend, (code, seconds) in ended.items():
        assert code > 0 and seconds < 10 + PARTITION_GRACE, (backend, code, seconds, done.stdout)
    left = dict(re.findall(r"^(\w+): (\d+) processes left on h1", done.stdout, re.M))
    assert left == {"mpi": "0", "gloo": "0"}, done.stdout
