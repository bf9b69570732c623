"""Which ``mpiexec`` to run, which MPI it belongs to, and the arguments that implementation needs.

MPICH's Hydra and Open MPI's mpiexec differ in what a laptop user trips over:

* Open MPI refuses to run as root (containers, CI) unless
  ``OMPI_ALLOW_RUN_AS_ROOT=1`` and ``OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1`` are set,
  and refuses more ranks than cores unless told to oversubscribe; it forwards
  to remote nodes only the variables named with ``-x``.
* Hydra (MPICH, Intel MPI) runs as root, oversubscribes and forwards the whole
  environment by default.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .._errors import LaunchError
from .._net import loopback_interface
from ._job import Launch, all_local, notice

__all__ = ["FORKER", "LOOPBACK_ENV", "Flavor", "check_library", "classify", "find_mpiexec", "hydra_args",
           "library_version", "loopback_env", "mpiexec_flavor", "openmpi_args", "single_host_forker"]

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


def openmpi_args(job: Launch, flavor: Flavor, env: dict[str, str], ours: list[str]) -> list[str]:
    args: list[str] = []
    if hasattr(os, "geteuid") and os.geteuid() == 0 and "OMPI_ALLOW_RUN_AS_ROOT" not in env:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        notice("running as root, so OMPI_ALLOW_RUN_AS_ROOT=1 and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 are set "
               "(Open MPI's mpiexec refuses root otherwise).")
    user = " ".join(job.mpi_args)
    placed = re.search(r"oversubscribe|--map-by|--host|-H\b|hostfile|machinefile", user, re.IGNORECASE)
    cores = _cores()
    if job.oversubscribe and not placed:  # more ranks than the hosts' slots: checked and asked for
        # by slot: Open MPI 5's default would put every extra rank on the first host
        args += ["--map-by", "slot:OVERSUBSCRIBE"] if flavor.version[:1] >= (5,) else ["--oversubscribe"]
    elif job.n > cores and not placed and all_local(job):
        args += ["--map-by", ":OVERSUBSCRIBE"] if flavor.version[:1] >= (5,) else ["--oversubscribe"]
        notice(f"{job.n} ranks on {cores} cores: adding `{' '.join(args)}` (Open MPI refuses more ranks "
               "than cores otherwise; expect each rank to run slower).")
    for name in ours:  # Open MPI forwards only named variables to other nodes
        args += ["-x", name]
    return args


def hydra_args(banner: str, watched: bool) -> list[str]:
    """MPICH's Hydra, every rank here and watched: the launcher, not Hydra, stops the ranks after a failure.

    Hydra kills every rank with SIGKILL the moment one dies, and a process killed first can
    be seen to go after those killed later (tearing down a large address space takes time),
    so the order of deaths would not say which rank failed. With ``-disable-auto-cleanup``
    the failing rank is the only one that dies by itself; the launcher, which watches every
    rank here, names it and stops the others. ``MPI_Abort`` still ends the job at once.
    (Hydra ignores the flag for a rank killed by a signal: each rank runs under a keeper,
    ``_keeper``, which turns the signal into an exit status.)

    ``watched``: every rank runs here and the launcher can see each one end (pidfds). Without
    that, the survivors of a rank killed by a signal could block in an MPI call forever, so
    Hydra keeps its own clean-up.
    """
    return ["-disable-auto-cleanup"] if watched and banner.startswith("Hydra") else []


FORKER = "mpiexec.gforker"


def single_host_forker(mpiexec: str, flavor: Flavor) -> str | None:
    """MPICH's ``mpiexec.gforker`` beside ``mpiexec`` (Hydra), for a job whose ranks all run here.

    Hydra's control port binds every interface (``0.0.0.0``) whatever ``-iface`` or ``-localhost``
    say, and its proxy and the ranks inherit it. The forker starts the ranks itself and talks PMI
    to each over a socketpair: the job then listens nowhere but on loopback. It tells a rank
    killed by a signal from one that exited 0 only through the rank's keeper (``_keeper``), and it
    stops no rank when one fails: the launcher, which watches each one, does. None where there is
    no forker (Intel MPI, MVAPICH builds without it): Hydra then, as before. Open MPI has none:
    its ``prterun`` listens on every interface and refuses a loopback-only control channel.
    """
    if flavor.family != "mpich" or not flavor.banner.startswith("Hydra"):
        return None
    for folder in dict.fromkeys((Path(mpiexec).parent, Path(os.path.realpath(mpiexec)).parent)):
        forker = folder / FORKER
        if forker.is_file() and os.access(forker, os.X_OK):
            return str(forker)
    return None


# Interface settings that keep a single-host job's listening sockets on the loopback interface:
# UCX (MPICH's ch4:ucx, Open MPI's pml ucx), libfabric's tcp and sockets providers (ch4:ofi, Intel
# MPI), Open MPI's TCP transport and its runtime's out-of-band channel (Open MPI 4's ORTE).
# The interface's name is looked up: ``lo`` on Linux, ``lo0`` on macOS and the BSDs.
LOOPBACK_ENV = {
    "UCX_NET_DEVICES": loopback_interface(),
    "FI_TCP_IFACE": loopback_interface(),
    "FI_SOCKETS_IFACE": loopback_interface(),
    "OMPI_MCA_btl": "^tcp",  # one host: shared memory; its TCP transport binds every interface regardless
    "OMPI_MCA_btl_tcp_if_include": loopback_interface(),  # where the user asks for TCP anyway
    "OMPI_MCA_oob_tcp_if_include": loopback_interface(),
}  # not PRRTE's oob_tcp_if_include (Open MPI 5): it refuses to run on loopback alone


def loopback_env(env: dict[str, str]) -> list[str]:
    """Confine the ranks' listeners to the loopback interface (every rank runs here); returns the names set.

    A setting the user made is kept, and so is its family: Open MPI refuses ``if_include``
    beside an ``if_exclude``. Not confinable: the control ports of mpiexec itself (Hydra's,
    Open MPI 5's prterun), which bind every interface whatever the settings.
    """
    added = []
    for name, value in LOOPBACK_ENV.items():
        if name in env or name.replace("_include", "_exclude") in env:
            continue
        env[name] = value
        added.append(name)
    return added


def check_library(mpiexec: str, flavor: Flavor) -> None:
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
