"""``phalanx info [--json]``: what this installation can run on.

The torch and MPI probes run in subprocesses (``python -m phalanx.cli._info
--probe torch|mpi``), so a library that hangs or crashes while loading, or a
CUDA driver that takes seconds to wake up, cannot take ``info`` down with it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from typing import Any

__all__ = ["collect", "main"]

PROBE_TIMEOUT = 60


def _probe_torch() -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"torch": "not installed"}
    found: dict[str, Any] = {"torch": torch.__version__}
    import torch.distributed as dist

    found["torch.distributed"] = (
        {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available()} if dist.is_available()
        else "not available"
    )
    found["cuda devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if torch.cuda.is_available():
        try:
            version = torch.cuda.nccl.version()
            found["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception as exc:  # noqa: BLE001 - report, never crash
            found["nccl"] = f"unknown ({exc})"
    return found


def _probe_mpi() -> dict[str, Any]:
    try:
        import mpi4py
    except ImportError:
        return {"mpi4py": "not installed"}
    found: dict[str, Any] = {"mpi4py": mpi4py.__version__}
    from ..launch._mpi_flavor import library_version

    found["MPI library"] = " ".join(library_version().strip().splitlines()[0].split())
    try:
        from mpi4py import MPI

        from phalanx.comm._mpi import detect_gpu_aware

        MPI.Init()  # a world of one: MPICH aborts the process if asked about GPUs before MPI_Init
        found["GPU-aware MPI"] = detect_gpu_aware(MPI)
        MPI.Finalize()
    except Exception as exc:  # noqa: BLE001
        found["GPU-aware MPI"] = f"unknown ({exc})"
    return found


def _ray_version() -> str:
    """Ray's version from its package metadata (importing ray takes seconds): 'not installed' without it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ray")
    except PackageNotFoundError:
        return "not installed (pip install 'phalanx[ray]' for Ray Train)"


def _probes(kinds: list[str]) -> dict[str, Any]:
    """Run the probes side by side, each in its own Python; merge what they found."""
    procs: dict[str, subprocess.Popen[str] | OSError] = {}
    for kind in kinds:
        try:
            procs[kind] = subprocess.Popen([sys.executable, "-m", "phalanx.cli._info", "--probe", kind],
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        except OSError as exc:
            procs[kind] = exc
    found: dict[str, Any] = {}
    for kind, proc in procs.items():
        if isinstance(proc, OSError):
            found[kind] = f"probe failed: {proc}"
            continue
        try:
            out, err = proc.communicate(timeout=PROBE_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            found[kind] = f"probe did not answer within {PROBE_TIMEOUT} s"
            continue
        try:
            found.update(json.loads(out.strip().splitlines()[-1]))
        except (ValueError, IndexError, TypeError):
            tail = (err.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
            found[kind] = f"probe failed: {tail}"
    return found


def _guarded(fn: Any) -> Any:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - info never crashes
        return f"error: {type(exc).__name__}: {exc}"


def collect() -> dict[str, Any]:
    """Everything ``phalanx info`` shows, as a JSON-ready dict."""
    import phalanx

    from ..launch._environment import describe_environment
    from ..launch._mpi_flavor import find_mpiexec, mpiexec_flavor

    found: dict[str, Any] = {
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": _guarded(platform.platform),
        "phalanx": f"{phalanx.__version__} ({os.path.dirname(phalanx.__file__)})",
        "numpy": _guarded(lambda: __import__("numpy").__version__),
        "environment": _guarded(describe_environment),
    }
    found.update(_probes(["torch", "mpi"]))
    found["ray"] = _guarded(_ray_version)
    mpiexec = find_mpiexec()
    found["mpiexec"] = f"{mpiexec} ({mpiexec_flavor(mpiexec).banner})" if mpiexec else "not found"

    def default() -> str:
        from ..launch import default_backend

        return default_backend()

    found["phalanx run default backend"] = _guarded(default)
    found["settings"] = _guarded(lambda: {k: getattr(phalanx.settings, k) for k in vars(phalanx.settings)})
    found["PHALANX_* environment"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("PHALANX_")}
    return found


def _text(found: dict[str, Any]) -> str:
    width = max(len(k) for k in found) + 1
    lines = []
    for key, value in found.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items()) or "(none)"
        elif isinstance(value, list):
            value = ", ".join(map(str, value)) or "none"
        elif isinstance(value, bool):
            value = "yes" if value else "no"
        lines.append(f"{key + ':':<{width}} {value}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="phalanx info", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    found = collect()
    print(json.dumps(found, indent=2, default=str) if args.json else _text(found))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--probe"]:
        kind = sys.argv[2]
        result = _guarded({"torch": _probe_torch, "mpi": _probe_mpi}[kind])
        print(json.dumps(result if isinstance(result, dict) else {kind: result}, default=str))
    else:
        sys.exit(main(sys.argv[1:]))
