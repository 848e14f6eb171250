"""What of the notebook's model travels to the workers and comes back, decided and checked in one place.

``ModelSpec``: the model object itself, pickled by its attributes (``model_graph``: nothing rebuilt from a
config), with the values of its weights and of every optimizer's state (slots, step counters, loss scale,
EMA, accumulators) beside it as raw arrays, so a checkpoint or a restart can replace them; lookup
vocabularies travel as the layers' own assets. A worker unpickles the model only after the connection is
authenticated (wire/protocol.py). What comes back from rank 0 is the same state in the same order
(worker/callbacks.py ``weights_and_optimizer``), applied to the notebook's model all at once or not at all
(``apply_state``).
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..data.structures import all_zero, leaves, map_struct
from ..errors import NbdistError
from . import graph as model_graph
from .tensors import buffer_variables, keras_data

_ITERATION_NAMES = ("iteration", "iterations", "step_counter")


@dataclass
class ModelSpec:
    graph: bytes  # the model object (model_graph.dump_graph), without the values below
    weights: list[np.ndarray]  # model.weights (get_weights' order)
    optimizer_weights: list[np.ndarray] | None = None  # optimizer_state_variables(model)
    iterations: int | None = None  # the compiled optimizer's step count: a trained model keeps counting
    assets: bytes | None = None  # the layers' assets (lookup vocabularies), model_graph.save_assets
    # Each optimizer's variables among model.weights, by index (built on arrival if needed), and
    # Keras's global settings (dtype policy, floatx) the model was made under.
    layout: list[list[int]] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    # Its torch modules' buffers (module_buffers' order) where they differ from the graph's: a checkpoint's.
    buffers: list[np.ndarray] | None = None


def is_keras_model(obj: Any) -> bool:
    keras = _keras_if_loaded()
    return keras is not None and isinstance(obj, keras.Model)


def _keras_if_loaded() -> Any:
    return sys.modules.get("keras")


def keras_own(model: Any, method: str) -> Any:
    """Keras' own ``fit``, ``train_on_batch`` or ``test_on_batch`` bound to ``model``, past an override in its
    class: the override (keras_hub's models preprocess there, into a tf.data pipeline) ran in the notebook,
    around the fit nbdist intercepted, and the worker's batches are what Keras' own fit was given. Evaluation
    and prediction call the model's own: nothing ran them in the notebook."""
    import keras

    return getattr(keras.Model, method).__get__(model, type(model))


def overrides(model: Any, method: str) -> bool:
    """Whether ``model``'s class has its own ``method`` (keras_hub's ``evaluate`` preprocesses, and takes arrays
    or a tf.data pipeline, not a generator of batches)."""
    import keras

    return getattr(type(model), method) is not getattr(keras.Model, method)


def ensure_built(model: Any, x: Any, y: Any, *, width: int | None = None) -> None:
    """Create every weight now, as ``fit``'s first step would: a subclassed model built with
    ``model.build(shape)`` has no weights in its inner layers until it is called, and a model without
    an input shape none at all. ``width``: the values per row of rows that are elsewhere (Spark's)."""
    if all(layer.built for layer in model._flatten_layers(include_self=False)) and (model.built or model.weights):
        return
    if x is None:  # the rows are elsewhere (a Spark DataFrame): build from the shape given to build()
        row = _row_from_build_shape(model)
        if row is None and width:
            row = np.zeros((1, width), dtype="float32")
        if row is None:
            return  # no complete shape recorded: each worker builds the model on its own rows
        try:
            with home_scope(model):
                model(row)  # no label here: the layers' weights are what must exist before launch
        except Exception as exc:
            raise NbdistError(f"the model could not be built on a zero row of {row.shape[1:]} values "
                              f"({_one_line(exc)}); give it an input shape, e.g. keras.Input({row.shape[1:]}), "
                              "or call it once on real rows before training.") from None
        return
    if any(getattr(leaf, "dtype", None) is not None and leaf.dtype.kind in "USO" for leaf in leaves(x)):
        return  # text: Keras's symbolic build takes no numpy strings; each worker's fit builds it on its rows
    try:
        first = lambda struct: map_struct(lambda a: a[:1], struct)  # one row of every input and output
        with home_scope(model):
            model._symbolic_build(data_batch=(keras_data(first(x)), keras_data(first(y))))
    except Exception as exc:
        raise NbdistError(f"the model could not be built on one row of the training data ({_one_line(exc)}); "
                          "check that the data fits the model's call().") from None


def _row_from_build_shape(model: Any) -> np.ndarray | None:
    """One zero row of the input shape passed to ``model.build(shape)``, if it was one complete shape."""
    shapes = getattr(model, "_build_shapes_dict", None) or {}
    if len(shapes) != 1:
        return None
    shape = next(iter(shapes.values()))
    if not isinstance(shape, (tuple, list)) or len(shape) < 2 or any(
            not isinstance(d, int) for d in shape[1:]):
        return None
    return np.zeros((1, *shape[1:]), dtype="float32")


# -- the state: what is averaged, what travels ----------------------------------------
def optimizer_state_variables(model: Any) -> list[Any]:
    return model_graph.optimizer_state_variables(model)


def averaged_optimizer_variables(model: Any) -> list[Any]:
    """Optimizer state worth averaging: float slots of every optimizer, not step counters, learning
    rates or a loss scale (each worker's own, see docs/architecture.md: what state travels)."""
    out = []
    for v in optimizer_state_variables(model):
        path = model_graph.variable_path(v)
        if "float" not in str(v.dtype) or path.rsplit("/", 1)[-1] in _ITERATION_NAMES or "dynamic_scale" in path:
            continue
        out.append(v)
    return out


def build_optimizer(model: Any) -> None:
    """Create optimizer slots now, so every worker has the same variables before training."""
    if not model.optimizer.built:
        with home_scope(model):
            model.optimizer.build(model.trainable_variables)


def home_scope(model: Any) -> Any:
    """The tf.distribute strategy scope the model was made in (Keras' fit builds in it; a MirroredStrategy's
    variables refuse new slots outside it), or no scope. On a worker that strategy is the worker's default."""
    strategy = getattr(model, "_distribute_strategy", None)
    return strategy.scope() if strategy is not None else contextlib.nullcontext()


def other_distribution(model: Any) -> str | None:
    """The one line saying that the distribution the cell set up (a ``keras.distribution``, a ``tf.distribute``
    strategy's scope) is replaced by nbdist's workers; None if it set none. The meaning is the same: one step
    on the global batch; each worker holds the whole model, placed on its own device (graph.py drops layouts)."""
    keras = _keras_if_loaded()
    names = []
    strategy = getattr(model, "_distribute_strategy", None)
    tf = sys.modules.get("tensorflow")
    if strategy is not None and tf is not None:  # set by Keras' TensorFlow trainer only when made in a scope
        public = [name for name, obj in vars(tf.distribute).items() if obj is type(strategy)]
        names.append(f"tf.distribute.{min(public, key=len) if public else type(strategy).__name__}")
    distribution = keras.distribution.distribution() if keras is not None else None
    if distribution is not None:
        names.append(f"keras.distribution.{type(distribution).__name__}")
    elif any(getattr(v, "_layout", None) is not None for v in model.weights):
        names.append("a keras.distribution layout")
    if not names:
        return None
    return (f"the cell's {' and '.join(dict.fromkeys(names))} is replaced by nbdist's workers, which each hold the "
            "whole model and train it on their share of the global batch.")


def optimizer_layout(model: Any) -> list[list[int]]:
    """For each optimizer (model_graph.optimizers_of), the indices in model.weights of the variables
    it was built for ([] while it is not built)."""
    where = {id(w): i for i, w in enumerate(model.weights)}
    out = []
    for opt in model_graph.optimizers_of(model):
        built = bool(getattr(opt, "built", False))
        out.append([where[id(v)] for v in opt._trainable_variables if id(v) in where] if built else [])
    return out


def build_optimizers(model: Any, layout: list[list[int]]) -> None:
    """Build each optimizer not yet built for the variables ``layout`` names (as it was elsewhere)."""
    weights = model.weights
    for opt, indices in zip(model_graph.optimizers_of(model), layout):
        if indices and not getattr(opt, "built", False):
            with home_scope(model):
                opt.build([weights[i] for i in indices])


def uses_ema(optimizer: Any) -> bool:
    """Whether ``optimizer`` keeps moving averages of the weights (``use_ema``), which Keras' fit writes into
    the model at its end (``finalize_variable_values``), looking through wrappers: a LossScaleOptimizer
    (what mixed_float16 compiles) says ``use_ema=False`` and delegates to its ``inner_optimizer``'s."""
    seen: set[int] = set()
    while optimizer is not None and id(optimizer) not in seen:
        if getattr(optimizer, "use_ema", False):
            return True
        seen.add(id(optimizer))
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return False


def step_counter(optimizer: Any) -> Any:
    """The optimizer's raw step variable: with ``gradient_accumulation_steps`` Keras' ``iterations`` is a
    tensor computed from it (applied updates), which cannot be assigned."""
    raw = getattr(optimizer, "_iterations", None)
    return optimizer.iterations if raw is None else raw


def optimizer_steps(model: Any) -> int | None:
    try:
        return int(np.asarray(step_counter(model.optimizer)))
    except Exception:  # an optimizer without a step counter
        return None


def keras_settings() -> dict[str, Any]:
    """Keras's global settings a model is made and trained under, for the workers to take."""
    import keras

    return {"dtype_policy": keras.config.dtype_policy().name, "floatx": keras.config.floatx(),
            "epsilon": keras.config.epsilon(), "image_data_format": keras.config.image_data_format(),
            "backend": keras.backend.backend()}


def apply_settings(settings: dict[str, Any]) -> None:
    if not settings:
        return
    import keras

    wanted, here = settings.get("backend"), keras.backend.backend()
    if wanted and wanted != here:  # the launcher sets KERAS_BACKEND; a user's image or wrapper may not
        raise NbdistError(f"the model was made with Keras on the {wanted} backend but this process's Keras runs on "
                          f"{here}; start it with KERAS_BACKEND={wanted} (nbdist's own launchers do).")

    keras.config.set_floatx(settings["floatx"])
    keras.config.set_epsilon(settings["epsilon"])
    keras.config.set_image_data_format(settings["image_data_format"])
    keras.config.set_dtype_policy(settings["dtype_policy"])


# -- driver: model -> spec -----------------------------------------------------
def spec_from_model(model: Any, strategy: str = "allreduce") -> ModelSpec:
    """The model as it travels to train; one sentence if it cannot, before any worker starts."""
    spec = travelling_model(model)
    check_strategy(model, strategy)
    return spec


def check_strategy(model: Any, strategy: str) -> None:
    """Allreduce averages the gradients ``model.optimizer`` applies; a model whose own train_step applies
    other optimizers (a GAN's two) would train them on each worker's gradients alone."""
    if strategy != "allreduce":
        return
    names = own_optimizers(model)
    if names:
        raise NbdistError(f"the model holds optimizers of its own besides model.optimizer ({names}), which its "
                          "train_step applies and --strategy allreduce cannot average; use --strategy averaging.")


def own_optimizers(model: Any) -> str:
    """The classes of the optimizers the model holds besides ``model.optimizer`` ("": none)."""
    others = [opt for opt in model_graph.optimizers_of(model) if opt is not model.optimizer]
    return ", ".join(sorted({type(o).__name__ for o in others}))


def chosen_strategy(model: Any, strategy: str | None) -> tuple[str, str | None]:
    """The strategy a run takes and the one-line notice when it is not the default's first choice.
    ``None`` (no --strategy) is allreduce, local Keras' step, unless the model's train_step applies
    optimizers of its own (a GAN's two): allreduce averages only model.optimizer's gradients, so averaging."""
    if strategy is not None:
        return strategy, None
    names = own_optimizers(model)
    if not names:
        return "allreduce", None
    return "averaging", (f"training with --strategy averaging: the model's train_step applies optimizers of its own "
                         f"besides model.optimizer ({names}), whose gradients allreduce cannot average.")


def travelling_model(model: Any, *, optimizer: bool = True) -> ModelSpec:
    """The spec (notebook classes and functions travel inside the pickled model); without ``optimizer``,
    for inference: its state is neither pickled nor sent. The model was checked at the door (checks.py)."""
    held = model_graph.check_resources(model)
    if held is not None:
        raise NbdistError(f"{held} that cannot be sent to the workers and that it cannot restore (it has no "
                          "load_assets()); keep that state in Keras variables or give the layer "
                          "save_assets()/load_assets().")
    if optimizer:  # its slots exist from here on, so a checkpoint's state always fits the spec's
        build_optimizer(model)
    drop_traced_losses(model)
    weights = list(model.weights)
    opt_vars = optimizer_state_variables(model)
    try:  # the optimizer's state never in the pickle: it travels beside it to train, not at all for inference
        graph = model_graph.dump_graph(model, weights + opt_vars)
    except Exception as exc:
        where = model_graph.unpicklable_part(model) or "an object the model holds"
        raise NbdistError(f"{where} cannot be sent to the workers ({_one_line(exc)}); create it inside the "
                          "layer or function that uses it, or hold what it is made from instead.") from None
    try:
        assets = model_graph.save_assets(model)
    except Exception as exc:
        raise NbdistError(f"a layer's assets (its vocabulary) could not be saved ({_one_line(exc)}); "
                          "adapt or set its vocabulary again and rerun.") from None
    spec = ModelSpec(graph, [snapshot(w) for w in weights], [snapshot(v) for v in opt_vars] if optimizer else None,
                     optimizer_steps(model) if optimizer else None, assets,
                     optimizer_layout(model) if optimizer else [], keras_settings())
    return spec


def drop_traced_losses(model: Any) -> None:
    """Keras leaves the losses a layer added in the last traced call (an activity regularizer's: graph
    tensors of a finished ``evaluate``/``fit`` step) in its ``_losses`` until its next call clears them; they
    mean nothing outside that trace and cannot travel, so they are cleared here as that call would."""
    def is_value(t: Any) -> bool:
        try:
            np.asarray(t)
            return True
        except Exception:
            return False

    for layer in model._flatten_layers(include_self=True):
        held = getattr(layer, "_losses", None)
        if held and not all(is_value(t) for t in held):
            held.clear()
            getattr(layer, "_loss_ids", set()).clear()


def view_of(tensor: Any) -> np.ndarray:
    """A NumPy view of an eager tensor's memory: ``numpy()`` copies it (300 MB a round, seconds on a loaded
    core). Read only, and only while the tensor lives (the view holds it)."""
    return tensor._numpy()


def host_array(variable: Any) -> np.ndarray:
    """A Keras variable's value as a NumPy array, read where TensorFlow holds it in host memory (``numpy()``
    copies it: 300 MB for a 25M-parameter model with Adam's slots). Valid until a step changes the
    variable: a later update writes a new buffer while this view holds the old one (a round in place,
    strategies/averaging.py ``variable_views``, does not): send it at once or copy it."""
    import keras

    value = getattr(variable, "value", None)  # a Keras variable's backend variable
    if keras.backend.backend() == "tensorflow" and hasattr(value, "value"):
        tensor = value.value()
        if tensor.device.endswith("CPU:0"):
            return view_of(tensor)
    return np.asarray(variable.numpy())


def snapshot(variable: Any) -> np.ndarray:
    """A copy of a variable's value; an all-zero one (a fresh optimizer's slot) as zeros the kernel has not
    yet given pages to, instead of a copy of hundreds of MB of them."""
    value = host_array(variable)
    return np.zeros(value.shape, dtype=value.dtype) if all_zero(value) else np.array(value)


# -- worker: spec -> model -----------------------------------------------------
def model_from_spec(spec: ModelSpec, *, weights: bool = True) -> Any:
    """The notebook's model on a worker (or a driver-side copy): its objects, then its state."""
    apply_settings(spec.settings)
    model = model_graph.load_graph(spec.graph)
    model_graph.load_assets(model, spec.assets)
    if not weights:
        return model
    set_values(model.weights, spec.weights, "weights")
    if spec.optimizer_weights is not None:
        build_optimizers(model, spec.layout)
        set_optimizer_weights(model, spec.optimizer_weights)
    if spec.iterations:  # Adam's bias correction and learning-rate schedules continue, not restart
        step_counter(model.optimizer).assign(int(spec.iterations))
    if spec.buffers:
        set_values(buffer_variables(model), spec.buffers, "module buffers")
    return model


def set_values(variables: list[Any], values: list[np.ndarray], what: str) -> None:
    if len(variables) != len(values):
        raise ValueError(f"the model has {len(variables)} {what}, got {len(values)} values")
    for v, value in zip(variables, values):
        v.assign(np.asarray(value).reshape(tuple(v.shape)))


def set_optimizer_weights(model: Any, values: list[np.ndarray]) -> None:
    """Every optimizer's state; a list of the averaged slots only (an older checkpoint's) is taken too."""
    full = optimizer_state_variables(model)
    if len(values) == len(full):
        set_values(full, values, "optimizer state variables")
        return
    set_values(averaged_optimizer_variables(model), values, "optimizer state variables")


def apply_state(model: Any, weights: list[np.ndarray], optimizer_values: list[np.ndarray] | None,
                layout: list[list[int]] | None = None, iterations: int | None = None,
                buffers: list[np.ndarray] | None = None) -> None:
    """Trained state into the notebook's model: all of it, or (on any mismatch) none of it. ``buffers``:
    its torch modules' buffers (model/tensors.py ``module_buffers``), where the workers sent them."""
    variables = list(model.weights)
    _check_shapes(variables, weights, "weights")
    if buffers:
        held = buffer_variables(model)
        _check_shapes(held, buffers, "module buffers")
        variables, weights = variables + held, list(weights) + list(buffers)
    opt_vars: list[Any] = []
    if optimizer_values is not None:
        build_optimizers(model, layout or [])
        build_optimizer(model)
        opt_vars = optimizer_state_variables(model)
        if len(opt_vars) != len(optimizer_values):
            opt_vars = averaged_optimizer_variables(model)
        _check_shapes(opt_vars, optimizer_values, "optimizer state variables")
    targets = variables + opt_vars
    before = [np.asarray(v.numpy()) for v in targets]
    steps = optimizer_steps(model)
    try:
        set_values(targets, list(weights) + list(optimizer_values or []), "state variables")
        if iterations is not None:
            step_counter(model.optimizer).assign(int(iterations))
    except Exception:
        set_values(targets, before, "state variables")
        if steps is not None:
            step_counter(model.optimizer).assign(steps)
        raise


def _check_shapes(variables: list[Any], values: list[np.ndarray], what: str) -> None:
    if len(variables) != len(values):
        raise NbdistError(f"the trained state does not fit the notebook's model ({len(values)} {what} for its "
                          f"{len(variables)}); the model was left as it was.")
    for v, value in zip(variables, values):
        if int(np.prod(v.shape)) != int(np.asarray(value).size):
            raise NbdistError(f"the trained state does not fit the notebook's model "
                              f"({model_graph.variable_path(v)} has shape {tuple(v.shape)}, got "
                              f"{np.asarray(value).shape}); the model was left as it was.")



# -- helpers -------------------------------------------------------------------
def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 160 else text[:157] + "..."
