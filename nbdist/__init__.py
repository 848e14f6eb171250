"""nbdist: data-parallel Keras training from a notebook cell.

``%load_ext nbdist`` registers ``%%dist_train``; ``nbdist.train`` is the same
thing as a function. The packages are layered (docs/architecture.md, "Layout"; checked by import-linter).

api.py: ``train()`` and ``TrainingJob``, the one door under the magics.
inference_api.py: the public ``evaluate()`` and ``predict()``.
config.py: ``TrainConfig``, the one typed configuration of a run.
fit_arguments.py: one ``model.fit(...)`` call's arguments as a typed value.
checks.py: the model checked against its data, and training kept finite.
errors.py: the exceptions a user sees.
version.py: the package version.
magics/: the IPython magics.
driver/: a run as the notebook sees it.
backends/: where workers come from (local, warm, containers).
spark/: workers as Spark barrier tasks, data on the executors.
worker/: the worker program.
strategies/: how the workers combine their training (allreduce, averaging, async).
wire/: the authenticated, typed messages between the driver and its workers.
data/: what data is and how it is dealt.
model/: what of the model travels and comes back.
machine/: processes, devices and the Keras backend.
search/: ``nbdist.tune``, Optuna searches of nbdist runs.
ui/: progress renderers and the dashboard.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .config import TrainConfig
from .errors import NbdistError, TrainingFailed
from .version import __version__

# The public functions are resolved on first use (PEP 562), so ``import nbdist`` stays light: their modules
# import numpy, and Keras, TensorFlow, torch or JAX only when a run needs them. Returning the functions
# themselves (not wrappers) is what makes help() and inspect.signature show their real signatures.
_PUBLIC = ("train", "evaluate", "predict", "tune")


def __getattr__(name: str) -> Any:
    if name == "train":
        from .api import train as function
    elif name == "evaluate":
        from .inference_api import evaluate as function
    elif name == "predict":
        from .inference_api import predict as function
    elif name == "tune":
        function = _public_tune()
    else:
        raise AttributeError(f"module 'nbdist' has no attribute {name!r}")
    globals()[name] = function  # resolved once
    return function


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


# make_search's parameters that only the magic and the search's own callers pass.
_TUNE_INTERNAL = frozenset({"listeners", "explicit", "lr_scaling_given"})


def _public_tune() -> Callable[..., Any]:
    """``search.tune`` with the keyword arguments it takes in its signature: it is written ``(build,
    **kwargs)`` and hands them to ``make_search``, whose signature names them."""
    import functools
    import inspect
    from inspect import Parameter

    from .search import entry as search

    own = inspect.signature(search.tune)
    if [p.kind for p in own.parameters.values()] != [Parameter.POSITIONAL_OR_KEYWORD, Parameter.VAR_KEYWORD]:
        return search.tune  # tune names its parameters itself
    maker = getattr(search, "make_search", None)
    if maker is None:
        return search.tune

    @functools.wraps(search.tune)
    def tune(build: Callable[[Any], Any], **kwargs: Any) -> Any:
        return search.tune(build, **kwargs)

    params = [p for p in inspect.signature(maker).parameters.values() if p.name not in _TUNE_INTERNAL]
    tune.__signature__ = own.replace(parameters=params)  # type: ignore[attr-defined]
    return tune


def load_ipython_extension(ipython) -> None:
    from .magics import DistMagics, EvaluateMagics, TuneMagics
    from .magics.train import continue_in_empty_cell

    ipython.register_magics(DistMagics)
    ipython.register_magics(EvaluateMagics)
    ipython.register_magics(TuneMagics)
    if continue_in_empty_cell not in ipython.input_transformers_cleanup:
        ipython.input_transformers_cleanup.append(continue_in_empty_cell)
    # Start the default local workers now, so the first %%dist_train finds TensorFlow imported; not when the
    # session turned warm workers off (%config DistMagics.warm_workers = False, or a profile's config).
    from .backends.local import start_warm_workers
    from .spark.backend import active_spark_session

    if ipython.magics_manager.registry["DistMagics"].warm_workers and active_spark_session() is None:
        start_warm_workers()  # with Spark active, runs go to its executors


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
