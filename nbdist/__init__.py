"""nbdist: data-parallel Keras training from a notebook cell.

``%load_ext nbdist`` registers ``%%dist_train``; ``nbdist.train`` is the same
thing as a function.
"""
from __future__ import annotations

from .config import TrainConfig
from .errors import NbdistError, TrainingFailed
from .version import __version__


def train(*args, **kwargs):
    from .api import train as _train

    return _train(*args, **kwargs)


train.__doc__ = "Train a compiled Keras model data-parallel; see nbdist.api.train."


def evaluate(*args, **kwargs):
    from .inference_api import evaluate as _evaluate

    return _evaluate(*args, **kwargs)


def predict(*args, **kwargs):
    from .inference_api import predict as _predict

    return _predict(*args, **kwargs)


def tune(*args, **kwargs):
    from .search import tune as _tune

    return _tune(*args, **kwargs)


tune.__doc__ = ("Search hyperparameters with Optuna, several trials at once, each an nbdist run pruned on merged "
                "metrics; see nbdist.search.tune.")

evaluate.__doc__ = ("Evaluate a compiled Keras model sharded over workers, metrics merged exactly; "
                    "see nbdist.inference_api.evaluate.")
predict.__doc__ = "Predict sharded over workers, rows in input order; see nbdist.inference_api.predict."


def load_ipython_extension(ipython) -> None:
    from .magics import DistMagics, EvaluateMagics, TuneMagics
    from .magics.train import continue_in_empty_cell

    ipython.register_magics(DistMagics)
    ipython.register_magics(EvaluateMagics)
    ipython.register_magics(TuneMagics)
    if continue_in_empty_cell not in ipython.input_transformers_cleanup:
        ipython.input_transformers_cleanup.append(continue_in_empty_cell)
    # Start the default local workers now, so the first %%dist_train finds TensorFlow imported.
    from .backends.local import start_warm_workers
    from .spark.backend import active_spark_session

    if active_spark_session() is None:  # with Spark active, runs go to its executors
        start_warm_workers()


def unload_ipython_extension(ipython) -> None:
    from .backends.warm import POOL
    from .magics import DistMagics, EvaluateMagics, TuneMagics
    from .magics.train import continue_in_empty_cell

    POOL.close()
    if continue_in_empty_cell in ipython.input_transformers_cleanup:
        ipython.input_transformers_cleanup.remove(continue_in_empty_cell)
    # IPython has no unregister; drop our names so a reload registers afresh.
    for kind in ("cell", "line"):
        table = ipython.magics_manager.magics[kind]
        for name in list(table):
            owner = getattr(table[name], "__self__", None)
            if isinstance(owner, (DistMagics, EvaluateMagics, TuneMagics)):
                del table[name]


__all__ = ["train", "evaluate", "predict", "tune", "TrainConfig", "NbdistError", "TrainingFailed", "__version__"]
