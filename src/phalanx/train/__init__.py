"""phalanx.train: a training loop over processes or in-process replicas (importing it imports torch).

::

    import phalanx, phalanx.train
    phalanx.init()
    history = phalanx.train.fit(model, torch.nn.functional.cross_entropy, optimizer, train_set,
                                batch_size=64, epochs=10, val_data=val_set,
                                checkpoint_dir="ckpt", resume="latest")

Parts: :func:`fit` and :class:`History` (the loop); checkpoints
(:func:`save_checkpoint`, :func:`load_checkpoint`, ...); loggers
(:class:`ConsoleLogger`, :class:`JSONLinesLogger`, :class:`TensorBoardLogger`,
:class:`WandbLogger`, :class:`MLflowLogger`, :func:`plot_curves`); datasets
(:func:`load_registry`, :class:`ImageFolder`, :class:`ImageNet`, ...); models
(:mod:`phalanx.train.models`). Names load on first use, so a missing optional
dependency only matters to the part that needs it.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    # the loop
    "fit": "._fit", "History": "._history", "TrainingError": "._fit", "evaluate": "._metrics",
    "StopSignal": "._signals",
    # checkpoints
    "save_checkpoint": "._checkpoint", "load_checkpoint": "._checkpoint",
    "capture_state": "._checkpoint", "restore_state": "._checkpoint",
    "CheckpointManager": "._checkpoint", "CheckpointError": "._checkpoint",
    # loggers
    "Logger": "._loggers", "ConsoleLogger": "._loggers", "JSONLinesLogger": "._loggers",
    "TensorBoardLogger": "._loggers", "WandbLogger": "._loggers", "MLflowLogger": "._loggers",
    "plot_curves": "._plot",
    # datasets
    "DatasetRegistry": "._registry", "load_registry": "._registry",
    "ImageFolder": "._images", "ImageNet": "._images",
    "train_transform": "._images", "eval_transform": "._images", "ImageReadError": "._images",
    "IMAGENET_MEAN": "._images", "IMAGENET_STD": "._images",
    "make_tiny_imagenet": "._tiny",
}

__all__ = sorted(_EXPORTS) + ["models"]


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
