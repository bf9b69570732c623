"""CUDA tensors through pinned host memory, for transports that reduce on the host (gloo, and an MPI
that is not GPU-aware).

::

    stages_cuda(backend)                  # does this backend move CUDA tensors through the host?
    host = to_host(x)                     # a pinned copy of CUDA ``x``; waits for that copy only
    host = to_host(x, torch.float32)      # widened on the GPU first (half precision reduced in float32)
    back_to_device(host, x)               # x := host, queued on x's stream; the host does not wait
    host = pinned_empty(shape, dtype)     # a pinned buffer for a result that goes to the GPU

Why (``docs/design.md``, "CUDA tensors"): ``x.cpu()`` allocates a pageable
buffer on every call and copies synchronously; a copy back from pageable
memory blocks the host again. Pinned buffers come from torch's caching host
allocator, so after the first call of a size no allocation happens, and a
block is reused only once the non-blocking copies recorded on it are done:
the copy back needs no host wait, later kernels on the stream are ordered
after it. The host waits only for the event behind its own copy out (the
values it is about to send), never ``torch.cuda.synchronize()``. Everything
here runs only for CUDA tensors: CPU tensors never reach it.

The gradient engine's buckets use persistent pinned twins and a side stream
(``torch/_staged.py``); this module serves single collectives.
"""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["back_to_device", "pinned_empty", "stages_cuda", "to_host"]


def _torch() -> Any:
    return sys.modules["torch"]


def stages_cuda(backend: Any) -> bool:
    """True when phalanx moves ``backend``'s CUDA tensors through host memory itself: gloo, or an MPI
    that is not GPU-aware (nccl and a GPU-aware MPI take device memory as it is). With
    ``PHALANX_GLOO_CUDA=direct`` gloo is handed CUDA tensors (ProcessGroupGloo stages them itself):
    the alternative ``benchmarks/gpu_step.py`` measures against this staging."""
    name = getattr(backend, "name", "")
    if name == "gloo":
        return os.environ.get("PHALANX_GLOO_CUDA", "staged") != "direct"
    return name == "mpi" and not getattr(backend, "gpu_aware", False)


def to_host(x: Any, dtype: Any = None) -> Any:
    """A pinned host copy of CUDA tensor ``x`` (cast to ``dtype`` on the GPU first when given), ready
    to read: the host waits for the event recorded after this copy on ``x``'s current stream only."""
    torch = _torch()
    src = x if dtype is None or x.dtype == dtype else x.to(dtype)
    host = torch.empty(tuple(src.shape), dtype=src.dtype, pin_memory=True)
    stream = torch.cuda.current_stream(src.device)
    with torch.cuda.stream(stream):
        host.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    done.synchronize()
    return host


def back_to_device(host: Any, x: Any) -> Any:
    """``x := host`` (a pinned tensor, cast to ``x``'s dtype on the GPU), queued on ``x``'s current
    stream without a host wait; the caching allocator keeps ``host`` until the copy has read it."""
    torch = _torch()
    with torch.cuda.device(x.device):
        if host.dtype != x.dtype:
            host = host.to(x.device, non_blocking=True)
        x.copy_(host, non_blocking=True)
    return x


def pinned_empty(shape: tuple[int, ...], dtype: Any) -> Any:
    """An uninitialised pinned host tensor (from the caching host allocator)."""
    return _torch().empty(shape, dtype=dtype, pin_memory=True)
