"""Data for the scaling model (:mod:`phalanx.cli._scaling`): named links and named models' tensor shapes.

Pure Python, no torch: the shapes of the named models are written out from their
architecture descriptions (torchvision's ResNet v1.5 bottleneck layout and VGG-16
configuration "D"), not read from an import. A 2-D (or 4-D convolution) weight is a
matrix ``(out, in·k·k)`` as PowerSGD reshapes it; biases and batch-norm parameters are
counted as ``vectors`` (always sent uncompressed).
"""

from __future__ import annotations

import dataclasses

__all__ = ["LINKS", "MODELS", "Link", "ModelShape"]


@dataclasses.dataclass(frozen=True)
class Link:
    """One link class of the α-β model: ``alpha`` seconds per message (latency), ``beta``
    seconds per byte (inverse bandwidth, one direction of a full-duplex link); ``note`` says
    where the numbers come from."""

    alpha: float
    beta: float
    note: str = ""

    @property
    def gbytes_per_s(self) -> float:
        """The link's effective bandwidth, 1/β, in GB/s (10⁹ bytes)."""
        return 1.0 / self.beta / 1e9 if self.beta > 0 else float("inf")


def _line(gbit: float, efficiency: float, alpha_us: float, note: str) -> Link:
    """A link of ``gbit`` Gbit/s line rate at ``efficiency`` (payload/line) with ``alpha_us`` latency."""
    return Link(alpha_us * 1e-6, 1.0 / (gbit * 1e9 / 8 * efficiency),
                f"{gbit:g} Gbit/s x {efficiency:g} payload efficiency, {alpha_us:g} us per message; {note}")


# Ethernet/TCP: 1448 payload bytes of every 1538 on the wire (MTU 1500, TCP/IP headers with
# timestamps, Ethernet framing, preamble, inter-frame gap) = 0.94. RoCE/InfiniBand: 4 KiB MTU,
# small headers, = 0.95 of the data rate (64b/66b encoding is already out of the quoted rates).
# Latencies: typical one-way small-message times of each stack (kernel TCP tens of us;
# RDMA 1-3 us), the order of magnitude the OSU micro-benchmarks report.
LINKS: dict[str, Link] = {
    "1gbe": _line(1, 0.94, 50, "kernel TCP over 1 Gbit Ethernet"),
    "10gbe": _line(10, 0.94, 25, "kernel TCP over 10 Gbit Ethernet"),
    "25gbe": _line(25, 0.94, 15, "kernel TCP over 25 Gbit Ethernet"),
    "25gbe-roce": _line(25, 0.95, 3, "RDMA over Converged Ethernet (RoCE v2), 25 Gbit"),
    "100gbe": _line(100, 0.90, 10, "kernel TCP over 100 Gbit Ethernet (TCP seldom fills it)"),
    "ib-edr-100": _line(100, 0.95, 1.5, "InfiniBand EDR 4x (100 Gbit/s data rate), RDMA verbs"),
    "ib-hdr-200": _line(200, 0.95, 1.5, "InfiniBand HDR 4x (200 Gbit/s data rate), RDMA verbs"),
    "nvlink": _line(1200, 0.85, 3, "NVLink 2 (V100 SXM2: 6 links x 25 GB/s each way), within a server"),
    "pcie3": _line(126, 0.80, 5, "PCIe 3.0 x16 (15.75 GB/s each way), GPU to GPU through the host"),
    "shm": _line(40, 1.0, 1, "CPU shared memory (~5 GB/s memcpy per core), within a host"),
}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A model's gradients as PowerSGD sees them: ``matrices`` ((rows, cols) of every weight of
    2 or more dimensions, reshaped to (out, rest)) and ``vectors`` (the count of parameters in
    1-D tensors: biases, norms)."""

    name: str
    matrices: tuple[tuple[int, int], ...]
    vectors: int

    @property
    def params(self) -> int:
        """The number of parameters."""
        return sum(n * m for n, m in self.matrices) + self.vectors


def _mlp() -> ModelShape:
    dims = [512, 1024, 1024, 1024, 1024, 1024, 10]  # the benchmark MLP: 512→1024→4×1024→10
    mats = tuple((o, i) for i, o in zip(dims, dims[1:], strict=False))
    return ModelShape("mlp", mats, sum(dims[1:]))


def _resnet(name: str, blocks: tuple[int, ...]) -> ModelShape:
    """torchvision's ResNet v1.5 with bottleneck blocks (expansion 4), 1000 classes."""
    mats: list[tuple[int, int]] = [(64, 3 * 7 * 7)]  # stem conv 7x7, no bias
    vectors = 2 * 64  # its batch norm (weight, bias)
    c_in = 64
    for width, count in zip((64, 128, 256, 512), blocks, strict=True):
        for b in range(count):
            mats += [(width, c_in), (width, width * 9), (4 * width, width)]
            vectors += 2 * (width + width + 4 * width)
            if b == 0:  # projection shortcut: 1x1 conv + batch norm
                mats.append((4 * width, c_in))
                vectors += 2 * 4 * width
            c_in = 4 * width
    mats.append((1000, 2048))
    return ModelShape(name, tuple(mats), vectors + 1000)


def _vgg16() -> ModelShape:
    """VGG-16 (configuration D, no batch norm), 224x224 input, 1000 classes."""
    mats: list[tuple[int, int]] = []
    vectors, c_in = 0, 3
    for c_out in (64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512):
        mats.append((c_out, c_in * 9))
        vectors += c_out
        c_in = c_out
    for i, o in ((512 * 7 * 7, 4096), (4096, 4096), (4096, 1000)):
        mats.append((o, i))
        vectors += o
    return ModelShape("vgg16", tuple(mats), vectors)


MODELS: dict[str, ModelShape] = {
    "mlp": _mlp(),
    "resnet50": _resnet("resnet50", (3, 4, 6, 3)),
    "resnet101": _resnet("resnet101", (3, 4, 23, 3)),
    "vgg16": _vgg16(),
}
