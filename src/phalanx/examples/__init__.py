"""Training scripts that run unchanged on one process or many.

::

    python -m phalanx.examples.digits                   # a world of one
    phalanx run -n 2 -m phalanx.examples.digits         # two processes, the same test accuracy
    phalanx demo                                        # both, and the comparison

:mod:`phalanx.examples.digits` trains a small network on scikit-learn's
bundled handwritten digits (no download); ``pip install 'phalanx[examples]'``
installs what it needs. In a clone of the repository the scripts are also
under ``examples/``.
"""
