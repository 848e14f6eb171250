"""The public functions show their real signatures and docstrings (help(), inspect.signature), although
``import nbdist`` does not import their modules (tests/workers/test_import_light.py)."""
from __future__ import annotations

import inspect
import pydoc

import pytest

import nbdist

PUBLIC = ("train", "evaluate", "predict", "tune")


def test_train_shows_its_real_parameters():
    params = inspect.signature(nbdist.train).parameters
    assert list(params)[:3] == ["model", "x", "y"]
    for name in ("validation_data", "callbacks", "class_weight", "sample_weight", "validation_split",
                 "initial_epoch", "features", "label", "options"):
        assert name in params, name
    assert params["options"].kind is inspect.Parameter.VAR_KEYWORD


def test_evaluate_predict_and_tune_show_their_real_parameters():
    assert {"model", "x", "y", "sample_weight"} <= set(inspect.signature(nbdist.evaluate).parameters)
    assert {"model", "x", "prediction_col"} <= set(inspect.signature(nbdist.predict).parameters)
    tune = inspect.signature(nbdist.tune).parameters
    assert {"build", "trials", "parallel", "objective", "storage", "ensemble"} <= set(tune)
    assert not {"listeners", "explicit", "lr_scaling_given"} & set(tune)  # the magic's own plumbing


@pytest.mark.parametrize("name", PUBLIC)
def test_each_public_function_has_its_docstring_in_help(name):
    function = getattr(nbdist, name)
    assert function.__doc__ and len(function.__doc__) > 100, name  # the real one, not a one-line pointer
    text = pydoc.render_doc(function, renderer=pydoc.plaintext)
    assert "*args" not in text and function.__doc__.split()[0] in text


def test_the_public_names_are_listed_and_resolve_to_one_object():
    assert set(PUBLIC) <= set(dir(nbdist))
    from nbdist import train, tune

    assert train is nbdist.train and tune is nbdist.tune
    with pytest.raises(AttributeError, match="no attribute 'trian'"):
        nbdist.trian  # noqa: B018
