"""nbdist: data-parallel Keras training from a notebook cell.

``%load_ext nbdist`` registers ``%%dist_train``; ``nbdist.train`` is the same
thing as a function.
"""
from __future__ import annotations

__version__ = "0.1.0"

from .config import TrainConfig  # noqa: E402
from .errors import NbdistError, TrainingFailed  # noqa: E402


def train(*args, **kwargs):  # noqa: ANN002, ANN003 - thin lazy wrapper, see api.train
    from .api import train as _train

    return _train(*args, **kwargs)


train.__doc__ = "Train a compiled Keras model data-parallel; see nbdist.api.train."


def load_ipython_extension(ipython) -> None:  # noqa: ANN001
    from .magics import DistMagics

    ipython.register_magics(DistMagics)


def unload_ipython_extension(ipython) -> None:  # noqa: ANN001
    from .magics import DistMagics

    # IPython has no unregister; drop our names so a reload registers afresh.
    for kind in ("cell", "line"):
        table = ipython.magics_manager.magics[kind]
        for name in list(table):
            owner = getattr(table[name], "__self__", None)
            if isinstance(owner, DistMagics):
                del table[name]


__all__ = ["train", "TrainConfig", "NbdistError", "TrainingFailed", "__version__"]
