"""Issue 46: an exception raised on a worker by Keras, TensorFlow or the cell's code is raised in the notebook as
its own type with its own message; nothing is imported for a type named on the wire."""
from __future__ import annotations

import pickle
import sys

import numpy as np
import pytest

from nbdist.driver.failures import rebuild
from nbdist.errors import TrainingFailed, raised_on_worker
from nbdist.worker.main import keras_raised, summarise, user_code_message


def rebuild_from_nbdist():
    from nbdist.data.sharding import shard_bounds

    shard_bounds(10, 0)  # nbdist's code raising a builtin


WRAPPED = """in user code:

    File "/site-packages/keras/src/backend/tensorflow/trainer.py", line 134, in one_step_on_data  *
        return self.train_step(data)
    File "/tmp/ipykernel_1/2.py", line 3, in picky  *
        raise ValueError("picky refuses\\nReceived: x")

    ValueError: picky refuses
    Received: x
"""


def test_a_workers_keras_error_is_rebuilt_as_its_type_and_nothing_else_is():
    assert user_code_message(WRAPPED, "ValueError") == "picky refuses\nReceived: x"
    assert user_code_message("plain\nmessage", "ValueError") == "plain\nmessage"
    assert summarise(ValueError(WRAPPED)) == "ValueError: picky refuses"  # the run's one line too
    err = rebuild("builtins:ValueError", "picky refuses", "Traceback ...", 1)
    assert type(err) is ValueError and raised_on_worker(err) and not isinstance(err, TrainingFailed)
    assert str(err) == "picky refuses" and err.rank == 1 and type(err).__name__ == "ValueError"
    assert err._render_traceback_()[1:] == ["Traceback ..."]
    again = pickle.loads(pickle.dumps(err))  # joblib, multiprocessing: it travels as the plain type does
    assert type(again) is ValueError and again.worker_traceback == "Traceback ..."
    for named in ("os:system", "builtins:KeyboardInterrupt", "builtins:print", "keras:__class__", "nbdist.errors:X"):
        assert rebuild(named, "m", "", 0) is None, named
    assert "keras.src.not_a_module" not in sys.modules and rebuild("keras.src.not_a_module:E", "m", "", 0) is None
    assert "not_imported_here" not in sys.modules and rebuild("not_imported_here:E", "m", "", 0) is None
    # On the worker: a builtin raised by the cell's code is the cell's; nbdist's own errors stay nbdist's.
    def cells_code():
        raise ValueError("from the cell")

    with pytest.raises(ValueError) as info:
        exec(compile("cells_code()", "<ipython-input-1>", "exec"), {"cells_code": cells_code})
    assert keras_raised(info.value) == ("builtins:ValueError", "from the cell")
    from nbdist.data.sharding import check_workers
    from nbdist.errors import NbdistError

    with pytest.raises(NbdistError) as own:  # nbdist's own sentence
        check_workers(1, 2)
    assert keras_raised(own.value) is None
    with pytest.raises(ValueError) as own:  # a builtin raised in nbdist's code
        rebuild_from_nbdist()
    assert keras_raised(own.value) is None
    with pytest.raises(KeyError) as info:
        {}["missing"]
    assert keras_raised(info.value) is not None  # raised here, in a test's (the user's) code


class CellsError(Exception):
    """A class as a notebook cell defines it (its module is the notebook's ``__main__``)."""


def test_an_exception_class_the_cell_defined_comes_back_as_itself(monkeypatch):
    monkeypatch.setattr(CellsError, "__module__", "__main__")
    monkeypatch.setattr(sys.modules["__main__"], "CellsError", CellsError, raising=False)

    def cells_code():
        raise CellsError("the cell's own")

    with pytest.raises(CellsError) as info:
        exec(compile("cells_code()", "<ipython-input-2>", "exec"), {"cells_code": cells_code})
    assert keras_raised(info.value) == ("__main__:CellsError", "the cell's own")
    err = rebuild("__main__:CellsError", "the cell's own", "Traceback ...", 0)
    assert type(err) is CellsError and str(err) == "the cell's own" and raised_on_worker(err)


def test_an_error_inside_a_jax_callback_is_told_by_its_own_line():
    """JAX wraps what a host callback raised (nbdist's gradient sum runs in one) as "INTERNAL: CpuCallback error
    calling callback: Traceback (most recent call last):", then the traceback: that head said nothing of why."""
    jax = pytest.importorskip("jax")
    from jax.experimental import io_callback

    def stuck(x):
        raise TimeoutError("worker 0 sent no gradients for 300 s (the collective timeout); it may be stuck")

    step = jax.jit(lambda x: io_callback(stuck, jax.ShapeDtypeStruct((), np.float32), x, ordered=True))
    with pytest.raises(Exception) as info:
        step(np.float32(1.0)).block_until_ready()
    assert summarise(info.value) == (f"{type(info.value).__name__}: TimeoutError: worker 0 sent no gradients for "
                                     "300 s (the collective timeout); it may be stuck")
