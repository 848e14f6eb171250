"""Cheap checks that the model and the data fit together, and that training stays finite.

Every check of a model against its data lives here, called once at each entry's door (api.py,
inference_api.py), on the driver before any worker starts (a mismatch otherwise surfaces as a
TensorFlow traceback from a worker). A loss that goes NaN or infinite is Keras' to act on (TerminateOnNaN):
the run trains on, as Keras' fit does, and says so once.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .data.inputs import FitData, PyDatasetData
from .errors import NbdistError


def input_shape(model: Any) -> tuple[int, ...] | None:
    try:
        shape = tuple(model.inputs[0].shape[1:]) if len(model.inputs) == 1 else None
    except (AttributeError, ValueError, TypeError):
        return None
    return None if shape is None or any(d is None for d in shape) else tuple(int(d) for d in shape)


def _output_shape(model: Any) -> tuple[Any, ...] | None:
    try:
        return tuple(model.outputs[0].shape) if len(model.outputs) == 1 else None
    except (AttributeError, ValueError, TypeError):
        return None


def check_text_inputs(model: Any, x: Any, what: str = "training data") -> None:
    """Text (str or bytes arrays) only where the model's input takes strings: one sentence before launch,
    not a cast error from every worker. Inputs are matched by name (a dict), position (a list) or alone."""
    try:
        inputs = list(model.inputs)
    except (AttributeError, ValueError, TypeError):
        return  # a subclassed model: its call decides what it takes
    if isinstance(x, dict):
        names = {getattr(t, "name", "").split(":")[0]: t for t in inputs}
        pairs = [(f"{what} {k!r}", v, names.get(str(k))) for k, v in x.items()]
    elif isinstance(x, (list, tuple)):
        pairs = [(f"{what} input {i}", v, inputs[i] if i < len(inputs) else None) for i, v in enumerate(x)]
    else:
        pairs = [(f"{what} features", x, inputs[0] if len(inputs) == 1 else None)]
    for name, value, tensor in pairs:
        kind = getattr(getattr(value, "dtype", None), "kind", "")
        if kind in ("U", "S") and tensor is not None and str(tensor.dtype) != "string":
            raise NbdistError(f"the {name} hold text (dtype {value.dtype}) but the model's input takes "
                              f"{tensor.dtype}; convert it first, e.g. .astype('float32'), or give the model "
                              "keras.Input(dtype='string') and a StringLookup or TextVectorization layer.")


def fits_input(row: tuple[Any, ...], expected: tuple[Any, ...]) -> bool:
    """Whether rows of shape ``row`` feed an input of per-row shape ``expected`` (None: any size), as
    Keras' functional models take them: one trailing axis of size 1 may be missing or extra."""
    row, expected = tuple(row), tuple(expected)
    if len(row) == len(expected) + 1 and row[-1:] == (1,):
        row = row[:-1]
    elif len(row) + 1 == len(expected) and expected[-1:] == (1,):
        expected = expected[:-1]
    return len(row) == len(expected) and all(e is None or e == r for r, e in zip(row, expected))


def check_model_fits_data(model: Any, x: np.ndarray, y: np.ndarray | None, what: str = "training data",
                          sample_weight: Any = None) -> None:
    """One sentence if ``x`` cannot feed the model or ``y`` cannot be the target of its loss."""
    check_text_inputs(model, x, what)
    expected = input_shape(model)
    if expected is not None and not fits_input(tuple(x.shape[1:]), expected):
        raise NbdistError(f"the {what} features have shape {tuple(x.shape[1:])} per row but the model expects "
                          f"{expected}; pass data shaped like the model's input or change keras.Input.")
    check_labels_fit_loss(model, y, sample_weight, what)
    check_class_ids(model, y, f"{what} ")


def check_labels_fit_loss(model: Any, y: Any, sample_weight: Any, what: str = "training data") -> None:
    """Where the model's own loss refuses these labels (model/labels.py), what Keras raises, raised before any
    worker starts, with a note of nbdist's: only where the local fit would fail too (a class id per time step
    or per pixel is Keras' to take)."""
    from .model.labels import loss_refusal

    error = loss_refusal(model, y, sample_weight)
    if error is None:
        return
    loss = getattr(model, "loss", None)
    name = _loss_name(loss)
    fix = "reshape the labels as it takes them"
    if isinstance(y, np.ndarray) and name in _ONE_HOT_NAMES and y.ndim == 1:
        fix = "one-hot encode y or use sparse_categorical_crossentropy"
    elif isinstance(y, np.ndarray) and name == "sparse_categorical_crossentropy" and y.ndim == 2 and y.shape[1] > 1:
        fix = "pass class ids (y.argmax(axis=1) for one-hot rows)"
    note = (f"nbdist: the {what} labels ({_shapes(y)}) do not fit {name} (Keras said so on a few rows, before any "
            f"worker started); {fix}.")
    error.add_note(note)
    # IPython shows Keras' sentence and nbdist's, not the traceback of this check.
    error._render_traceback_ = lambda: [f"{type(error).__name__}: {' '.join(str(error).split())}", note]
    raise error.with_traceback(None)


_ONE_HOT_NAMES = ("categorical_crossentropy", "categorical_focal_crossentropy", "categorical_hinge")


def _loss_name(loss: Any) -> str:
    """The loss as the user named it: its name, a Keras loss object's or function's name, or its losses."""
    if isinstance(loss, str):
        return loss
    if isinstance(loss, (dict, list, tuple)):
        return "the model's losses"
    return str(getattr(loss, "name", None) or getattr(loss, "__name__", None) or type(loss).__name__)


def _shapes(y: Any) -> str:
    if isinstance(y, dict):
        return ", ".join(f"{k!r}: shape {tuple(np.shape(v))}" for k, v in y.items())
    if isinstance(y, (list, tuple)):
        return ", ".join(f"shape {tuple(np.shape(v))}" for v in y)
    return f"shape {tuple(np.shape(y))}"


def non_finite(logs: dict[str, Any]) -> str | None:
    """The first metric in a merged epoch's logs that is NaN or infinite, by name."""
    for key in sorted(logs, key=lambda k: (k != "loss", k)):  # the loss first: it is the cause
        value = logs[key]
        if isinstance(value, (int, float)) and not math.isfinite(value):
            return key
    return None


def non_finite_message(metric: str, value: float, epoch: int) -> str:
    return (f"{metric} became {value} in epoch {epoch + 1}; training goes on as Keras' fit does (add "
            "keras.callbacks.TerminateOnNaN() to stop there, or lower the learning rate or scale the features).")


# -- what a %%dist_train cell does, read from its code (never run to find out) ---------------------
_LOOP_MARKS = {"GradientTape": "tf.GradientTape", "apply_gradients": "optimizer.apply_gradients",
               "train_on_batch": "model.train_on_batch"}


def custom_training_loop(source: str) -> str | None:
    """The mark of a hand-written training loop in a cell that never calls ``.fit(...)``, if any.

    Read with ``ast``: a ``tf.GradientTape``, ``apply_gradients`` or ``train_on_batch`` outside any
    class body (inside one it is a subclassed model's own ``train_step``, which ``fit`` runs). None
    when the cell calls ``.fit(...)`` (that call is what trains) or cannot be parsed.
    """
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    found: list[str] = []

    def visit(node: ast.AST, in_class: bool) -> bool:
        """False once a ``.fit(...)`` call is seen."""
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) and child.func.attr == "fit":
                return False
            name = (child.attr if isinstance(child, ast.Attribute)
                    else child.id if isinstance(child, ast.Name) else None)
            if name in _LOOP_MARKS and not in_class:
                found.append(_LOOP_MARKS[name])
            if not visit(child, in_class or isinstance(child, ast.ClassDef)):
                return False
        return True

    return found[0] if visit(tree, False) and found else None


def check_no_custom_loop(source: str) -> None:
    """One sentence, before the cell runs, for a cell that trains with its own loop instead of ``fit``."""
    mark = custom_training_loop(source)
    if mark is not None:
        raise NbdistError(f"this cell trains with its own loop ({mark}, no model.fit), which nbdist cannot split "
                          "over workers: move the step into your model's train_step (subclass keras.Model and "
                          "override train_step), compile the model, then call model.fit(...) in the cell.")


def check_not_stateful(model: Any) -> None:
    """One sentence for a stateful RNN: its state carries each batch row's stream into the next batch."""
    for layer in getattr(model, "_flatten_layers", lambda: [])():
        if getattr(layer, "stateful", False):
            try:
                batch = model.inputs[0].shape[0]
            except (AttributeError, IndexError, TypeError, ValueError):
                batch = None
            size = f"its fixed batch size of {batch}" if batch else "its fixed batch size"
            raise NbdistError(f"layer {layer.name!r} is stateful (stateful=True with {size}): each row of a "
                              "batch continues a stream from the same row of the previous batch, and nbdist "
                              "splits every batch over the workers, so no worker would see whole streams; "
                              "train it with a local model.fit, or set stateful=False.")


# -- the model against its data: every entry (train, a cell's fit, evaluate, predict, a trial) checks here -----
def _keras_model(obj: Any) -> bool:
    import sys

    keras = sys.modules.get("keras")  # a Keras model exists only once keras is imported
    return keras is not None and isinstance(obj, keras.Model)


def check_keras_model(model: Any, name: str) -> None:
    if not _keras_model(model):
        raise NbdistError(f"{name} is a {type(model).__name__}, not a Keras model; pass a keras.Model.")


def check_trainable(model: Any, name: str = "model", *, built: bool = True) -> None:
    """A compiled Keras model; with ``built``, one that has its weights (the door builds an unbuilt one on
    its data first, as Keras' own fit does: ``model_io.ensure_built``, then ``check_built``)."""
    check_keras_model(model, name)
    if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
        raise NbdistError(
            f"{name} is not compiled; call {name}.compile(optimizer, loss, metrics=[...]) in the cell."
        )
    if built:
        check_built(model, name)


def check_built(model: Any, name: str = "model") -> None:
    """Every weight exists (after ``ensure_built``): the workers' weights come back into them."""
    if not model.built and not model.weights:  # a GAN's outer model is not built but holds built parts
        raise NbdistError(
            f"{name} has no weights yet; give it an input shape, e.g. keras.Input((64,)) as its first layer."
        )


def check_inference_model(model: Any, name: str, need_compiled: bool) -> None:
    """A built model for predict; compiled too (its loss and metrics) for evaluate."""
    import warnings

    check_keras_model(model, name)
    if not model.built or not model.weights:
        raise NbdistError(f"{name} has no weights yet (it was never built or trained); train it first, "
                          "e.g. with %%dist_train or model.fit.")
    if need_compiled:
        check_compiled(model, name)
    if need_compiled and not _has_trained(model):
        warnings.warn(f"{name} has never been trained (its optimizer took no step); the metrics describe its "
                      "initial weights — ignore this if you loaded trained weights.", stacklevel=3)


def check_compiled(model: Any, name: str) -> None:
    """Evaluation needs the model's loss and metrics."""
    if not getattr(model, "compiled", False):
        raise NbdistError(f"{name} is not compiled, so it has no loss or metrics to evaluate; call "
                          f"{name}.compile(optimizer, loss, metrics=[...]) first.")


def _has_trained(model: Any) -> bool:
    """model.fit builds the optimizer and counts steps; %%dist_train builds it but leaves the count at 0."""
    opt = getattr(model, "optimizer", None)
    try:
        return opt is None or bool(opt.built) or int(np.asarray(opt.iterations)) > 0
    except Exception:  # an optimizer without a step counter: nothing to judge by
        return True


def outputs(model: Any) -> int:
    return len(getattr(model, "outputs", None) or [None])


def check_single_output_on_spark(model: Any, what: str) -> None:
    """A DataFrame's label and prediction are one column each: Spark takes single-output models."""
    if outputs(model) > 1:
        raise NbdistError(f"the model has several outputs, and a Spark DataFrame is {what} with one label or "
                          "prediction column; pass the rows in memory as a dict or list per output (e.g. from "
                          "df.toPandas()), or a single-output model.")


def no_columns(features: Any, label: Any, weight_col: Any = None) -> None:
    """Column names belong to Spark data only."""
    if features is not None or label is not None:
        raise NbdistError("--features and --label name the columns of a Spark DataFrame; with numpy or "
                          "pandas data pass --data X,y instead.")
    if weight_col is not None:
        raise NbdistError("--weight-col names a Spark DataFrame's column of per-row weights; with numpy or pandas "
                          "data pass the weights themselves as sample_weight (model.fit(x, y, sample_weight=w)).")


def check_class_ids(model: Any, y: Any, what: str) -> None:
    """Sparse class ids within the classes of a single-output classifier (``what``: whose labels)."""
    from .model.metrics import classifier_spec, compiled_loss, labels_are_classes

    out = _output_shape(model)
    if y is None or out is None:
        return
    spec = classifier_spec(compiled_loss(model), out)
    if spec is not None and spec.kind == "multiclass" and spec.sparse_labels and not labels_are_classes(y, spec):
        raise NbdistError(f"the {what}labels must be whole class ids from 0 to {spec.classes - 1} for this "
                          f"{spec.classes}-output model; check y or the model's last layer.")


def check_label_column(model: Any, label: str | None) -> None:
    """A DataFrame's numeric label column (one value per row) as the target of the model's one output."""
    from .model.metrics import check_labels, compiled_loss

    output_shape = tuple(model.outputs[0].shape) if getattr(model, "outputs", None) else ()
    if output_shape:
        check_labels((1,), output_shape, compiled_loss(model), what=f"label column {label!r} values")


def check_fits_model(model: Any, train_set: FitData | PyDatasetData, val_set: FitData | PyDatasetData | None) -> None:
    """Training and validation data (FitData; a PyDataset's batches are read by the workers) against the
    model, built on them already (``model_io.ensure_built``), as its fit would."""
    for data, what in ((train_set, "training data"), (val_set, "validation data")):
        if not isinstance(data, FitData):
            continue
        check_none_inputs(model, data)
        if isinstance(data.x, np.ndarray) and (data.y is None or isinstance(data.y, np.ndarray)):
            check_model_fits_data(model, data.x, data.y, what, data.sample_weight)
        else:
            check_text_inputs(model, data.x, what)
            check_labels_fit_loss(model, data.y, data.sample_weight, what)  # several outputs: labels per output


def check_none_inputs(model: Any, data: FitData) -> None:
    """An input given as None (Keras takes None for an optional input): the model called on one row as the
    local fit's first step calls it, so a required input raises Keras' own ValueError before any worker starts.
    Any other failure of that call is left to the workers' fit, which runs the model as the user wrote it."""
    if not _has_none(data.x):
        return
    from .data.structures import map_struct
    from .model.spec import home_scope

    try:
        with home_scope(model):
            model(map_struct(lambda a: a[:1], data.x), training=False)
    except ValueError as exc:
        raise exc.with_traceback(None) from None
    except Exception:
        return


def _has_none(struct: Any) -> bool:
    if isinstance(struct, dict):
        return any(_has_none(v) for v in struct.values())
    if isinstance(struct, (list, tuple)):
        return any(_has_none(v) for v in struct)
    return struct is None


def check_inference_data(model: Any, data: FitData | PyDatasetData, what: str, name: str, need_labels: bool) -> None:
    """evaluate's or predict's rows (FitData) or PyDataset (its first batch) against the model."""
    batches = isinstance(data, PyDatasetData)
    if batches and need_labels and len(data.first_row) < 2:
        raise NbdistError(f"the {what} is a PyDataset whose batches hold no labels; return (x, y) or "
                          "(x, y, sample_weight) from its __getitem__ to evaluate on it.")
    from .model.spec import overrides

    if overrides(model, "evaluate" if need_labels else "predict"):
        return  # the class's own method runs on the workers and takes the rows as it wants them (keras_hub's resize)
    x = data.first_row[0] if batches else data.x
    expected = input_shape(model)
    if expected is not None and isinstance(x, np.ndarray) and not fits_input(x.shape[1:], expected):
        if batches:
            raise NbdistError(f"the PyDataset's batches have features of shape {tuple(x.shape[1:])} per row but "
                              f"{name} expects {expected}; return batches shaped like the training data.")
        raise NbdistError(f"the features have shape {tuple(x.shape[1:])} per row but {name} expects "
                          f"{expected}; pass data shaped like the training data.")
    check_text_inputs(model, x, what)
    if need_labels and not batches and isinstance(data.y, np.ndarray) and outputs(model) == 1:
        check_labels_fit_loss(model, data.y, data.sample_weight, what)
        if data.sample_weight is None:  # the classifier report counts rows: weighted, it has none
            check_class_ids(model, data.y, "")
