"""phalanx.train: a training loop over processes or in-process replicas (torch loads on first use).

::

    import phalanx, phalanx.train
    phalanx.init()
    history = phalanx.train.fit(model, torch.nn.functional.cross_entropy, optimizer, train_set,
                                batch_size=64, epochs=10, val_data=val_set,
                                checkpoint_dir="ckpt", resume="latest")

Parts: :func:`fit`, :class:`FitOptions` and :class:`History` (the loop); checkpoints
(:func:`save_checkpoint`, :func:`load_checkpoint`, ...); loggers
(:class:`ConsoleLogger`, :class:`JSONLinesLogger`, :class:`TensorBoardLogger`,
:class:`WandbLogger`, :class:`MLflowLogger`, :func:`plot_curves`); datasets
(:func:`load_registry`, :class:`ImageFolder`, :class:`ImageNet`, ...); models
(:mod:`phalanx.train.models`). Names load on first use, so a missing optional
dependency only matters to the part that needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    # the loop
    "fit": "._fit", "FitOptions": "._options", "History": "._history", "evaluate": "._metrics",
    "StopSignal": "._signals", "TrainingError": ".._errors",
    # checkpoints
    "save_checkpoint": "._checkpoint", "load_checkpoint": "._checkpoint",
    "capture_state": "._state", "restore_state": "._state",
    "CheckpointManager": "._manager", "CheckpointError": ".._errors",
    # loggers
    "Logger": "._loggers", "ConsoleLogger": "._loggers", "JSONLinesLogger": "._loggers",
    "TensorBoardLogger": "._integrations", "WandbLogger": "._integrations", "MLflowLogger": "._integrations",
    "plot_curves": "._plot",
    # datasets
    "DatasetRegistry": "._registry", "load_registry": "._registry",
    "ImageFolder": "._images", "ImageNet": "._images", "ImageReadError": ".._errors",
    "train_transform": "._transforms", "eval_transform": "._transforms",
    "IMAGENET_MEAN": "._transforms", "IMAGENET_STD": "._transforms",
    "make_tiny_imagenet": "._tiny",
}

if TYPE_CHECKING:  # what the lazy names below are, for type checkers and editors (never run)
    from .._errors import CheckpointError, ImageReadError, TrainingError
    from . import models
    from ._checkpoint import load_checkpoint, save_checkpoint
    from ._fit import fit
    from ._history import History
    from ._images import ImageFolder, ImageNet
    from ._integrations import MLflowLogger, TensorBoardLogger, WandbLogger
    from ._loggers import ConsoleLogger, JSONLinesLogger, Logger
    from ._manager import CheckpointManager
    from ._metrics import evaluate
    from ._options import FitOptions
    from ._plot import plot_curves
    from ._registry import DatasetRegistry, load_registry
    from ._signals import StopSignal
    from ._state import capture_state, restore_state
    from ._tiny import make_tiny_imagenet
    from ._transforms import IMAGENET_MEAN, IMAGENET_STD, eval_transform, train_transform

__all__ = [  # every name of _EXPORTS, and models
    "CheckpointError", "CheckpointManager", "ConsoleLogger", "DatasetRegistry", "FitOptions", "History",
    "IMAGENET_MEAN", "IMAGENET_STD", "ImageFolder", "ImageNet", "ImageReadError", "JSONLinesLogger",
    "Logger", "MLflowLogger", "StopSignal", "TensorBoardLogger", "TrainingError", "WandbLogger",
    "capture_state", "eval_transform", "evaluate", "fit", "load_checkpoint", "load_registry",
    "make_tiny_imagenet", "models", "plot_curves", "restore_state", "save_checkpoint", "train_transform",
]


def __getattr__(name: str) -> Any:
    if name == "models":
        return importlib.import_module(".models", __name__)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'phalanx.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
