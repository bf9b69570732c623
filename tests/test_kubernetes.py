"""What Kubeflow's operators do, reproduced on 3 simulated hosts, and the manifests of docs/kubernetes.md.

No cluster runs here. A ``PyTorchJob`` is one process per pod, ``python train.py``, with the
variables the training operator sets (``pkg/controller.v1/pytorch/envvar.go`` ``setPodEnv``,
``master.go``): one simulated host per pod, ``h0`` the master, and exactly those variables plus
``PHALANX_SECRET`` from the Secret, nothing of this process's launch environment. An
``MPIJob`` is its launcher's command on ``h0`` with the MPI operator's launcher variables and
an MPICH-format host file naming the worker hosts ``h1``, ``h2`` (``mpi_job_controller.go``
``newConfigMap``, ``mpichEnvVars``). Each run trains with ``fit`` and a
``DistributedOptimizer`` loop (``program_hosts_equal.py``) and must equal one process on the
same global batch; the pods without the secret must each fail at once, saying where to put it.
The manifests are read from docs/kubernetes.md and must agree with what the simulation sets.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import AVAILABLE
from helpers import requires_hosts
from phalanx.testing import SimulatedHosts, simulated_hosts

pytest.importorskip("torch")
yaml = pytest.importorskip("yaml")

HERE = Path(__file__).resolve().parent
DOC = HERE.parent / "docs" / "kubernetes.md"
SCRIPT = HERE / "program_hosts_equal.py"
VENV = Path(sys.executable).parent.parent
TOL = 1e-9
JOB_TIMEOUT = 120

PODS = 3            # the manifest's Master (1) + Worker (2) replicas, one process each
MASTER_PORT = 23456  # the manifest's pytorchjob-port
SECRET = "9d2c4b7e11aa3f60" * 4
# What the training operator sets in every container of a PyTorchJob with nprocPerNode "1".
PYTORCHJOB_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "PET_NPROC_PER_NODE", "PET_NODE_RANK",
                   "PET_NNODES", "PYTHONUNBUFFERED")
POD_VARS = ("PHALANX_SECRET",)  # what the manifest's env: adds
# What the MPI operator sets in the launcher container for mpiImplementation: MPICH.
LAUNCHER_VARS = ("HYDRA_HOST_FILE", "HYDRA_LAUNCH_EXTRA_ARGS", "K_MPI_JOB_ROLE")
WORKERS = 2  # the MPIJob's Worker replicas, slotsPerWorker 1



def container_base() -> dict[str, str]:
    """A container's own environment: the image's PATH and HOME, nothing of a launcher."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root")}


def pytorchjob_env(rank: int, secret: str | None) -> dict[str, str]:
    env = dict(container_base(), MASTER_ADDR="h0", MASTER_PORT=str(MASTER_PORT), WORLD_SIZE=str(PODS),
               RANK=str(rank), PET_NPROC_PER_NODE="1", PET_NODE_RANK=str(rank), PET_NNODES=str(PODS),
               PYTHONUNBUFFERED="0")
    assert sorted(set(env) - set(container_base())) == sorted(PYTORCHJOB_VARS)
    if secret is not None:
        env["PHALANX_SECRET"] = secret
    return env


def manifests() -> dict[str, dict[str, Any]]:
    """The YAML blocks of docs/kubernetes.md, by kind."""
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    found = {}
    for block in blocks:
        for doc in yaml.safe_load_all(block):
            found[doc["kind"]] = doc
    return found


def section(number: str) -> str:
    """The text of docs/kubernetes.md's section ``## <number> ...``."""
    [found] = [part for part in DOC.read_text().split("\n## ") if part.startswith(number + " ")]
    return found


def containers(spec: dict[str, Any], replica: str) -> list[dict[str, Any]]:
    return spec[replica]["template"]["spec"]["containers"]  # type: ignore[no-any-return]


def check_results(directory: Path, size: int, hosts: list[str], backend: str) -> None:
    results = [json.loads((directory / f"rank-{r}.json").read_text()) for r in range(size)]
    assert [r["host"] for r in results] == hosts, results
    assert {(r["size"], r["backend"]) for r in results} == {(size, backend)}, results
    for rank, result in enumerate(results):
        assert result["fit"] <= TOL, f"rank {rank}: fit differs from one process by {result['fit']:.3g}"
        assert result["optimizer"] <= TOL, f"rank {rank}: DistributedOptimizer differs by {result['optimizer']:.3g}"


@pytest.fixture(scope="module")
def hosts() -> Iterator[SimulatedHosts]:
    with simulated_hosts(3) as made:
        yield made


def wait_gone(hosts: SimulatedHosts) -> None:
    deadline = time.monotonic() + 10
    while any(hosts.pids(i) for i in range(len(hosts))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(hosts.pids(i) for i in range(len(hosts))), {f"h{i}": hosts.pids(i) for i in range(len(hosts))}


# --- the manifests (no hosts needed, but the module needs them: cheap) -------------------------

def test_pytorchjob_manifest_sets_the_variables_port_and_replicas_the_simulated_pods_get() -> None:
    job = manifests()["PyTorchJob"]
    spec = job["spec"]["pytorchReplicaSpecs"]
    assert job["spec"]["nprocPerNode"] == "1"  # PET_NPROC_PER_NODE, and WORLD_SIZE = pods
    assert spec["Master"]["replicas"] + spec["Worker"]["replicas"] == PODS
    ports = [p for c in containers(spec, "Master") for p in c.get("ports", [])]
    assert ports == [{"name": "pytorchjob-port", "containerPort": MASTER_PORT}], ports  # the operator's MASTER_PORT
    for replica in ("Master", "Worker"):
        for c in containers(spec, replica):
            assert c["name"] == "pytorch" and c["command"] == ["python", "train.py"], c
            assert tuple(e["name"] for e in c["env"]) == POD_VARS, c["env"]
            ref = c["env"][0]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": "phalanx-secret", "key": "secret"}, ref
    assert "kubectl create secret generic phalanx-secret \\\n    --from-literal=secret=" in DOC.read_text()
    table = re.findall(r"^\| `([A-Z_]+)` \|", section("1."), re.M)
    assert sorted(table) == sorted(PYTORCHJOB_VARS), table


def test_mpijob_manifest_has_the_launcher_command_slots_and_workers_the_simulation_uses() -> None:
    job = manifests()["MPIJob"]
    assert job["spec"]["mpiImplementation"] == "MPICH" and job["spec"]["slotsPerWorker"] == 1
    spec = job["spec"]["mpiReplicaSpecs"]
    assert spec["Launcher"]["replicas"] == 1 and spec["Worker"]["replicas"] == WORKERS
    [launcher] = containers(spec, "Launcher")
    assert launcher["command"] == ["phalanx", "run", "--hostfile", "/etc/mpi/hostfile", "-n", str(WORKERS),
                                   "train.py"], launcher
    assert "env" not in launcher  # the MPI backend needs no secret; the operator's variables only
    [worker] = containers(spec, "Worker")
    assert worker["command"] == ["/usr/sbin/sshd", "-De"], worker
    table = re.findall(r"^\| `([A-Z_]+)` \|", section("2."), re.M)
    assert sorted(table) == sorted(LAUNCHER_VARS), table


# --- PyTorchJob: one process per pod ----------------------------------------------------------

@requires_hosts
@pytest.mark.skipif("gloo" not in AVAILABLE, reason="backend 'gloo' is not available here (see `phalanx info`)")
def test_pytorchjob_pods_with_only_the_operators_variables_and_secret_train_equal_one_process(
        hosts: SimulatedHosts, tmp_path: Path) -> None:
    procs = [hosts.popen(i, [sys.executable, str(SCRIPT), str(tmp_path)], env=pytorchjob_env(i, SECRET),
                         cwd=str(HERE), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(PODS)]
    outputs = [p.communicate(timeout=JOB_TIMEOUT)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * PODS, outputs
    check_results(tmp_path, PODS, hosts.names, "gloo")
    wait_gone(hosts)


@requires_hosts
@pytest.mark.skipif("gloo" not in AVAILABLE, reason="backend 'gloo' is not available here (see `phalanx info`)")
def test_pytorchjob_pods_without_the_secret_fail_at_once_saying_to_put_it_in_a_kubernetes_secret(
        hosts: SimulatedHosts, tmp_path: Path) -> None:
    start = time.monotonic()
    procs = [hosts.popen(i, [sys.executable, str(SCRIPT), str(tmp_path)], env=pytorchjob_env(i, None),
                         cwd=str(HERE), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(PODS)]
    outputs = [p.communicate(timeout=JOB_TIMEOUT)[0] for p in procs]
    took = time.monotonic() - start
    for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode != 0, (rank, out)
        assert "RendezvousError" in out and "PHALANX_SECRET is not set" in out, (rank, out)
        assert "Kubernetes" in out and "Secret" in out and "docs/kubernetes.md" in out, (rank, out)
    assert took < 30, f"the pods took {took:.1f} s to fail (torch's import included): not at once"
    assert not list(tmp_path.iterdir()), "no rank may have trained"
    wait_gone(hosts)


# --- MPIJob: the launcher's command with the operator's host file -----------------------------

@requires_hosts
@pytest.mark.skipif("mpi" not in AVAILABLE, reason="backend 'mpi' is not available here (see `phalanx info`)")
@pytest.mark.parametrize("launcher", ["phalanx-run", "mpirun"])
def test_mpijob_launcher_with_the_operators_hostfile_trains_equal_one_process(
        hosts: SimulatedHosts, launcher: str, tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"  # /etc/mpi/hostfile, in mpi-operator's MPICH format ("name:slots")
    hostfile.write_text("".join(f"{name}:1\n" for name in hosts.names[1:1 + WORKERS]))
    out = tmp_path / "out"
    out.mkdir()
    env = dict(container_base(), HYDRA_HOST_FILE=str(hostfile), HYDRA_LAUNCH_EXTRA_ARGS="-o ConnectionAttempts=10",
               K_MPI_JOB_ROLE="launcher")
    assert sorted(set(env) - set(container_base())) == sorted(LAUNCHER_VARS)
    if launcher == "phalanx-run":
        cmd = [str(VENV / "bin" / "phalanx"), "run", "--hostfile", str(hostfile), "-n", str(WORKERS),
               "--rsh", hosts.rsh, "--timeout", "60", str(SCRIPT), str(out)]
    else:  # Hydra reads HYDRA_HOST_FILE; the simulation's ssh stand-in in place of ssh
        env["HYDRA_LAUNCHER_EXEC"] = hosts.rsh
        env["PATH"] = f"{VENV / 'bin'}{os.pathsep}{env['PATH']}"
        cmd = [str(VENV / "bin" / "mpirun"), "-n", str(WORKERS), sys.executable, str(SCRIPT), str(out)]
    done = hosts.run(0, cmd, env=env, cwd=str(HERE), capture_output=True, text=True, timeout=JOB_TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    check_results(out, WORKERS, hosts.names[1:1 + WORKERS], "mpi")
    wait_gone(hosts)


# --- which environment `phalanx info` reports ---------------------------------------------------

ENVIRONMENTS = {
    "ray-train-worker": ({"RAY_RAYLET_PID": "7", "RANK": "1", "WORLD_SIZE": "2", "KUBERNETES_SERVICE_HOST": "x"},
                         "Ray Train worker (rank 1 of 2)"),
    "ray-driver": ({"RAY_ADDRESS": "ray://head:10001"}, "a Ray driver (RAY_ADDRESS=ray://head:10001)"),
    "pytorchjob-pod": (dict(pytorchjob_env(1, None), KUBERNETES_SERVICE_HOST="10.0.0.1"),
                       "Kubeflow PyTorchJob pod (rank 1 of 3, master h0:23456; PHALANX_SECRET is not set"),
    "mpijob-launcher": ({"K_MPI_JOB_ROLE": "launcher", "HYDRA_HOST_FILE": "/etc/mpi/hostfile",
                         "KUBERNETES_SERVICE_HOST": "x"},
                        "Kubeflow MPIJob launcher pod (host file /etc/mpi/hostfile): start the ranks with "
                        "`phalanx run --hostfile /etc/mpi/hostfile`"),
    "other-pod": ({"KUBERNETES_SERVICE_HOST": "x"}, "a Kubernetes pod (no training operator's variables)"),
    "slurm": ({"SLURM_JOB_ID": "77", "SLURM_NTASKS": "4", "SLURM_PROCID": "2"}, "Slurm job 77 (4 tasks, task 2)"),
    "torchrun": ({"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2"}, "torchrun (rank 0 of 2)"),
    "phalanx-run": ({"PHALANX_BACKEND": "gloo", "PHALANX_JOB_DIR": "/tmp/j"}, "phalanx run --backend gloo"),
    "none": ({"PATH": "/bin"}, "none detected"),
}


@pytest.mark.parametrize("name", list(ENVIRONMENTS))
def test_describe_environment_names_ray_kubeflow_slurm_torchrun_and_phalanx_run(name: str) -> None:
    from phalanx.launch._environment import describe_environment

    env, expected = ENVIRONMENTS[name]
    assert describe_environment(env).startswith(expected), describe_environment(env)


def test_phalanx_info_reports_the_pytorchjob_pod_it_runs_in() -> None:
    env = dict(os.environ, **pytorchjob_env(2, SECRET), KUBERNETES_SERVICE_HOST="10.0.0.1")
    done = subprocess.run([sys.executable, "-m", "phalanx", "info", "--json"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["environment"] == "Kubeflow PyTorchJob pod (rank 2 of 3, master h0:23456)", found["environment"]
    assert "ray" in found, found
