"""Horovod's top-level API on phalanx: ``phalanx.horovod.run`` (and ``phalanx.horovod.torch``)."""
