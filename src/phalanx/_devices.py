"""Which torch device a rank (or an in-process replica) uses: one resolution for the whole library.

Used by :func:`phalanx.device`, the nccl backend and ``phalanx.torch``'s
replicas, so the rule and its errors are the same everywhere. torch is
imported here only when a function is called (``import phalanx`` stays light).
"""

from __future__ import annotations

from typing import Any

from ._errors import InvalidArgumentError

__all__ = ["cuda_count", "parse_device", "rank_device"]


def cuda_count() -> int:
    """The number of visible CUDA GPUs (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def parse_device(call: str, spec: Any, gpus: int | None = None) -> Any:
    """``spec`` (``'cpu'``, ``'cuda:1'``, ``torch.device``, an int GPU index) as a checked torch.device.

    ``call`` names the public call in errors (``phalanx.{call}``); ``gpus`` is
    the visible GPU count (asked when not given). A CUDA device without an
    index is the current one. Raises InvalidArgumentError for anything that is
    not a CPU or visible CUDA device.
    """
    import torch

    gpus = cuda_count() if gpus is None else gpus
    try:
        device = torch.device("cuda", spec) if isinstance(spec, int) and not isinstance(spec, bool) \
            else torch.device(spec)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise InvalidArgumentError(
            f"phalanx.{call}: {spec!r} is not a device ({exc}). Use e.g. 'cpu', 'cuda:0', "
            "torch.device('cuda', 1) or a GPU index.") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise InvalidArgumentError(
            f"phalanx.{call}: device {spec!r} is of type {device.type!r}; phalanx runs on 'cpu' and "
            "'cuda' devices.")
    if gpus == 0:
        raise InvalidArgumentError(
            f"phalanx.{call}: device {spec!r} is a GPU, but no GPU is visible here "
            "(torch.cuda.is_available() is False). Use 'cpu' devices.")
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= gpus:
        raise InvalidArgumentError(
            f"phalanx.{call}: device {spec!r} does not exist; {gpus} GPU"
            f"{' is' if gpus == 1 else 's are'} visible (cuda:0 to cuda:{gpus - 1}).")
    return torch.device("cuda", index)


def rank_device(call: str, devices: list[Any] | None, local_rank: int) -> Any:
    """The device of the rank with node-local rank ``local_rank``.

    ``devices[local_rank]`` when the user listed devices (``phalanx.init(devices=...)``),
    else GPU ``local_rank % device_count``, else the CPU when no GPU is visible.
    Raises InvalidArgumentError when ``devices`` has no entry for this rank.
    """
    import torch

    gpus = cuda_count()
    if devices is None:
        return torch.device("cuda", local_rank % gpus) if gpus else torch.device("cpu")
    if local_rank >= len(devices):
        raise InvalidArgumentError(
            f"phalanx.{call}: init(devices={devices!r}) lists {len(devices)} devices but this node runs "
            f"local rank {local_rank}; give one device per rank on the node, e.g. "
            f"devices={[f'cuda:{i}' for i in range(local_rank + 1)]!r}.")
    return parse_device(call, devices[local_rank], gpus)
