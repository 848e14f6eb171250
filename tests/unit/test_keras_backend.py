"""Which Keras backend a worker runs (issue 25): the notebook's, carried in its environment (pure)."""
from __future__ import annotations

import json

from nbdist.backends.command import STARTUP_KEYS, worker_env
from nbdist.machine.keras_backend import configured_backend, missing_package


def test_a_worker_is_given_the_notebooks_backend_whatever_its_own_environment_says(monkeypatch):
    monkeypatch.delitem(__import__("sys").modules, "keras", raising=False)  # as on a Spark executor
    assert worker_env(1, {"KERAS_BACKEND": "torch"})["KERAS_BACKEND"] == "torch"
    assert worker_env(1, {"KERAS_BACKEND": "torch"}, backend="jax")["KERAS_BACKEND"] == "jax"  # a Spark task's


def test_warm_workers_are_matched_on_the_backend():
    """Two environments that differ only in the backend never share a warm worker (spark/warm.py's key,
    backends/warm.py's whole environment)."""
    assert "KERAS_BACKEND" in STARTUP_KEYS
    assert worker_env(1, {}, backend="jax") != worker_env(1, {}, backend="torch")


def test_the_backend_comes_from_the_environment_then_keras_json(tmp_path):
    (tmp_path / "keras.json").write_text(json.dumps({"backend": "jax"}))
    assert configured_backend({"KERAS_HOME": str(tmp_path)}) == "jax"
    assert configured_backend({"KERAS_HOME": str(tmp_path), "KERAS_BACKEND": "torch"}) == "torch"
    assert configured_backend({"KERAS_HOME": str(tmp_path / "none")}) == "tensorflow"


def test_a_missing_backend_package_is_one_sentence_naming_what_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "jax" else real(name, *a))
    message = missing_package("jax")
    assert message is not None and "pip install 'jax[cpu]'" in message and message.count(". ") == 0
    assert missing_package("torch") is None
    assert "does not support" in (missing_package("mlx") or "")


def test_a_process_on_another_backend_refuses_the_model_in_one_sentence():
    """The job carries the notebook's backend: a worker whose Keras runs another one (a user's image that
    sets its own KERAS_BACKEND) says what to set instead of failing somewhere inside Keras."""
    import keras
    import pytest

    from nbdist.errors import NbdistError
    from nbdist.model.spec import apply_settings, keras_settings

    settings = keras_settings()
    assert settings["backend"] == keras.backend.backend()
    apply_settings(settings)  # the same backend: taken as it is
    other = "jax" if keras.backend.backend() != "jax" else "torch"
    with pytest.raises(NbdistError, match=f"KERAS_BACKEND={other}"):
        apply_settings({**settings, "backend": other})


def test_the_compiled_loss_is_described_as_keras_serializer_describes_it():
    """nbdist reads the compiled loss without ``get_compile_config()`` (it imports TensorFlow on any backend);
    what the checks and the classifier report read from it is the same as from Keras' own description."""
    import keras

    from nbdist.model.metrics import _keras_loss, compiled_loss, loss_identity

    def my_loss(y_true, y_pred):
        return keras.losses.mean_squared_error(y_true, y_pred)

    losses = ["sparse_categorical_crossentropy", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              keras.losses.binary_crossentropy, keras.losses.BinaryCrossentropy(), keras.losses.MeanSquaredError(),
              my_loss, None]
    for loss in losses:
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile("sgd", loss)
        ours, keras_own = compiled_loss(model), model.get_compile_config()["loss"]
        assert loss_identity(ours) == loss_identity(keras_own), loss
        assert _keras_loss(ours) == _keras_loss(keras_own), loss
    assert loss_identity(compiled_loss(model)) == (None, False)
    assert loss_identity(compiled_loss(keras.Sequential([keras.Input((4,))]))) == (None, False)  # not compiled
