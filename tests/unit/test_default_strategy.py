"""Issue 39: with no --strategy a run takes allreduce, local Keras' step; a model whose own train_step
applies optimizers besides model.optimizer (a GAN's two) falls back to averaging with a one-line notice,
while an explicit --strategy allreduce for it stays refused. Nothing starts: the job is only prepared."""
from __future__ import annotations

import keras
import numpy as np
import pytest
from IPython.core.magic_arguments import parse_argstring

from nbdist.api import fit_arguments, prepare_fit
from nbdist.config import TrainConfig
from nbdist.errors import NbdistError
from nbdist.magics.train import DistMagics
from nbdist.magics.tune import TuneMagics


class TwoOptimizers(keras.Model):
    """keras.io's GAN shape in brief: a second optimizer of its own, applied by its train_step."""

    def __init__(self) -> None:
        super().__init__()
        self.body = keras.layers.Dense(4)
        self.head = keras.layers.Dense(3, activation="softmax")
        self.head_optimizer = keras.optimizers.SGD(0.1)

    def call(self, x):
        return self.head(self.body(x))


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(40, 5)).astype("float32"), rng.integers(0, 3, 40)


def _prepared(model, **options):
    x, y = _data()
    config = TrainConfig(epochs=1, batch_size=8, workers=2, ui="none", mlflow=False, **options)
    return prepare_fit(model, config, fit_arguments(x, y, config), None)


def test_the_default_is_allreduce_on_the_config_and_the_magic_lines():
    assert TrainConfig().strategy is None  # resolved at launch: allreduce unless the model cannot
    assert parse_argstring(DistMagics.dist_train, "--workers 2").strategy is None
    assert parse_argstring(TuneMagics.dist_tune, "").strategy is None
    assert "default: allreduce" in " ".join(DistMagics.dist_train.parser.format_help().split())


def test_a_plain_model_trains_with_allreduce_by_default(caplog):
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy")
    with caplog.at_level("WARNING", logger="nbdist"):
        job = _prepared(model)
    assert job.config.strategy == "allreduce" and not caplog.records


def test_a_model_with_its_own_optimizers_falls_back_to_averaging_in_one_line(caplog):
    model = TwoOptimizers()
    model.compile("adam", "sparse_categorical_crossentropy")
    with caplog.at_level("WARNING", logger="nbdist"):
        job = _prepared(model)
    assert job.config.strategy == "averaging"
    [notice] = [r.getMessage() for r in caplog.records]
    assert notice.startswith("training with --strategy averaging: the model's train_step applies optimizers of its "
                             "own besides model.optimizer (SGD)") and "\n" not in notice
    assert _prepared(model, strategy="averaging").config.strategy == "averaging"
    with pytest.raises(NbdistError, match="--strategy allreduce cannot average; use --strategy averaging"):
        _prepared(model, strategy="allreduce").start()


def test_an_averaging_frequency_without_a_strategy_asks_for_averaging(monkeypatch):
    """--averaging-frequency has no meaning under allreduce: given alone it chooses averaging (on the magic
    lines and in the API), where under the new default it was ignored without a word."""
    from nbdist.config import implied_strategy

    assert implied_strategy({"averaging_frequency": 10}) == {"averaging_frequency": 10, "strategy": "averaging"}
    assert implied_strategy({"averaging_frequency": 10, "strategy": "allreduce"})["strategy"] == "allreduce"
    assert implied_strategy({}) == {}
    assert parse_argstring(DistMagics.dist_train, "--workers 2").averaging_frequency is None  # the default: 5
    class Prepared(Exception):
        pass

    def prepare_fit(model, config, *args, **kwargs):  # nothing starts: the config is what is checked
        raise Prepared(config)

    monkeypatch.setattr("nbdist.api.prepare_fit", prepare_fit)
    import nbdist

    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3, activation="softmax")])
    model.compile("sgd", "sparse_categorical_crossentropy")
    with pytest.raises(Prepared) as prepared:
        nbdist.train(model, *_data(), averaging_frequency=10, workers=2)
    config = prepared.value.args[0]
    assert config.strategy == "averaging" and config.averaging_frequency == 10
    assert TrainConfig().averaging_frequency == 5
