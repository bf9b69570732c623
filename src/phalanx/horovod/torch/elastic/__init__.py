"""Horovod's elastic training API on phalanx's restart model: ``hvd.elastic.run``, ``TorchState``,
``ElasticSampler``.

::

    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()          # saved to disk (atomically), collective

    train(state)                    # run under `phalanx run -n 4 --max-restarts 3 train.py`

As in Horovod, a job on gloo (``horovodrun --gloo -np N --min-np M``, or
``--max-restarts K`` for replacements; one host) resets inside the running
processes: the survivors restore the last commit, re-form the world
(``phalanx.reform``), run the reset callbacks and sync; a replacement joins at
the next ``commit()`` (``HostsUpdatedInterrupt``). Elsewhere phalanx ends the
failed job and starts it again (``phalanx run --max-restarts K``):
``commit()`` also writes the state to disk, and in a restarted job
(``PHALANX_RESTART_COUNT`` > 0) :func:`run` loads the last commit before it
calls the function. Without either the script runs as an ordinary job and
says so once. The commits go to ``$PHALANX_ELASTIC_DIR`` (default
``./.phalanx-elastic/<script name>/``). Details: ``docs/horovod.md``.
"""

from __future__ import annotations

from ._run import run
from ._sampler import ElasticSampler
from ._state import ObjectState, State, TorchState

__all__ = ["ElasticSampler", "ObjectState", "State", "TorchState", "run"]
