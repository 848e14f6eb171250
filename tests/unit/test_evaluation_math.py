"""The merging maths of evaluation: summed shard state equals the whole-data answer (milliseconds)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import confusion_matrix, f1_score, precision_recall_fscore_support, roc_auc_score

from nbdist.data.sharding import shard_bounds
from nbdist.errors import NbdistError
from nbdist.model.metrics import (
    ClassifierSpec,
    check_labels,
    classifier_spec,
    confusion_counts,
    merge_classifier_stats,
    merge_histograms,
    roc_auc,
    score_histogram,
    shard_statistics,
    sum_states,
)


def _uneven_splits(n: int, rng: np.random.Generator, parts: int) -> list[tuple[int, int]]:
    cuts = np.sort(rng.choice(np.arange(1, n), size=parts - 1, replace=False))
    edges = [0, *cuts.tolist(), n]
    return list(zip(edges[:-1], edges[1:]))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(20, 400), k=st.integers(2, 7), parts=st.integers(1, 5), seed=st.integers(0, 10_000))
def test_multiclass_report_from_merged_shards_equals_sklearn(n: int, k: int, parts: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, k, n)
    probs = rng.dirichlet(np.ones(k), size=n).astype("float32")
    spec = ClassifierSpec("multiclass", k, True, 0.5)
    shards = [shard_statistics(y[a:b], probs[a:b], spec) for a, b in _uneven_splits(n, rng, parts)]
    out = merge_classifier_stats(shards, spec)
    pred = probs.argmax(axis=1)
    labels = list(range(k))
    np.testing.assert_array_equal(out["confusion_matrix"], confusion_matrix(y, pred, labels=labels))
    p, r, f, s = precision_recall_fscore_support(y, pred, labels=labels, zero_division=0)
    for c in labels:
        assert out["per_class"][c]["precision"] == pytest.approx(p[c], abs=1e-12)
        assert out["per_class"][c]["recall"] == pytest.approx(r[c], abs=1e-12)
        assert out["per_class"][c]["f1"] == pytest.approx(f[c], abs=1e-12)
        assert out["per_class"][c]["support"] == s[c]
    avg = out["averages"]
    assert avg["accuracy"] == pytest.approx(float(np.mean(pred == y)), abs=1e-12)
    assert avg["macro_f1"] == pytest.approx(f1_score(y, pred, labels=labels, average="macro", zero_division=0))
    assert avg["weighted_f1"] == pytest.approx(f1_score(y, pred, labels=labels, average="weighted",
                                                        zero_division=0))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(10, 500), parts=st.integers(1, 6), levels=st.sampled_from([3, 10, 1000, 0]),
       seed=st.integers(0, 10_000))
def test_exact_auc_from_merged_histograms_equals_sklearn(n: int, parts: int, levels: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    y[0], y[1] = 0, 1  # both classes present
    scores = rng.random(n).astype("float32")
    if levels:  # heavy ties, which a per-shard average would mangle
        scores = np.round(scores * levels) / levels
    hists = [score_histogram(scores[a:b], y[a:b] == 1) for a, b in _uneven_splits(n, rng, parts)]
    assert roc_auc(merge_histograms(hists)) == pytest.approx(roc_auc_score(y, scores), abs=1e-12)


def test_averaging_per_shard_auc_would_be_wrong_but_merging_is_exact() -> None:
    # Shard 1 separates perfectly at low scores, shard 2 at high scores: each shard's AUC is 1.
    y = np.array([0, 1, 0, 1])
    s = np.array([0.1, 0.2, 0.8, 0.9])
    per_shard = [roc_auc_score(y[:2], s[:2]), roc_auc_score(y[2:], s[2:])]
    assert np.mean(per_shard) == 1.0
    merged = roc_auc(merge_histograms([score_histogram(s[:2], y[:2] == 1), score_histogram(s[2:], y[2:] == 1)]))
    assert merged == pytest.approx(roc_auc_score(y, s)) and merged == 0.75


def test_binary_report_uses_keras_threshold_and_positive_class() -> None:
    y = np.array([0, 0, 1, 1, 1], dtype="float32")
    p = np.array([[0.2], [0.5], [0.5001], [0.9], [0.4]], dtype="float32")  # 0.5 itself is negative in Keras
    spec = classifier_spec("binary_crossentropy", (None, 1))
    out = merge_classifier_stats([shard_statistics(y[:2], p[:2], spec), shard_statistics(y[2:], p[2:], spec)], spec)
    np.testing.assert_array_equal(out["confusion_matrix"], [[2, 0], [1, 2]])
    assert out["averages"]["precision"] == 1.0 and out["averages"]["recall"] == pytest.approx(2 / 3)


def test_soft_labels_give_no_classifier_report() -> None:
    spec = classifier_spec("binary_crossentropy", (None, 1))
    y = np.array([0.2, 0.9], dtype="float32")
    assert shard_statistics(y, np.array([[0.1], [0.8]]), spec) is None
    assert merge_classifier_stats([None, {"confusion": np.eye(2, dtype=int)}], spec) is None


def test_sum_states_is_elementwise_and_checks_shapes() -> None:
    a = [np.float32(2.0).reshape(()), np.arange(3, dtype="float32")]
    b = [np.float32(5.0).reshape(()), np.ones(3, dtype="float32")]
    total = sum_states([a, b])
    assert total[0] == 7.0 and total[1].tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(NbdistError, match="different shapes"):
        sum_states([a, [b[0], np.ones(4)]])


@pytest.mark.parametrize("loss,shape,kind", [
    ("binary_crossentropy", (None, 1), "binary"),
    ("sparse_categorical_crossentropy", (None, 10), "multiclass"),
    ({"module": "keras.losses", "class_name": "CategoricalCrossentropy",
      "config": {"name": "categorical_crossentropy", "from_logits": True}}, (None, 3), "multiclass"),
    ({"module": "builtins", "class_name": "function", "config": "sparse_categorical_crossentropy"}, (None, 4),
     "multiclass"),
    ("mse", (None, 1), None),
    ("binary_crossentropy", (None, 5), None),  # multi-label: no single class per row
])
def test_classifier_spec(loss, shape, kind) -> None:
    spec = classifier_spec(loss, shape)
    assert (spec.kind if spec else None) == kind


def test_binary_logits_threshold_is_zero() -> None:
    loss = {"class_name": "BinaryCrossentropy", "config": {"name": "binary_crossentropy", "from_logits": True}}
    assert classifier_spec(loss, (None, 1)).threshold == 0.0


def test_label_shape_mismatch_is_one_sentence() -> None:
    with pytest.raises(NbdistError, match=r"labels have shape \(10,\) per row but sparse_categorical"):
        check_labels((50, 10), (None, 10), "sparse_categorical_crossentropy")
    with pytest.raises(NbdistError, match=r"model outputs \(10,\) per row \(integer class ids need"):
        check_labels((50,), (None, 10), "categorical_crossentropy")
    with pytest.raises(NbdistError, match=r"labels have shape \(3,\) per row but the model outputs \(1,\)"):
        check_labels((50, 3), (None, 1), "mse")
    check_labels((50,), (None, 10), "sparse_categorical_crossentropy")
    check_labels((50, 1), (None, 1), "binary_crossentropy")


def test_a_notebook_loss_function_takes_any_label_shape() -> None:
    """Keras's config of a notebook function: local fit decides what labels it takes, not nbdist."""
    def fn(name: str) -> dict:
        return {"module": "builtins", "class_name": "function", "config": name, "registered_name": "function"}

    check_labels((50,), (None, 10), fn("my_loss"))
    check_labels((50,), (None, 10), {"module": None, "class_name": "MyLoss", "config": {}})
    with pytest.raises(NbdistError, match=r"labels have shape \(\) per row but the model outputs \(10,\)"):
        check_labels((50,), (None, 10), fn("mean_squared_error"))


def test_labels_outside_the_model_classes() -> None:
    with pytest.raises(NbdistError, match=r"outside 0..2"):
        confusion_counts(np.array([0, 3]), np.array([0, 1]), 3)


def test_auc_with_one_class_is_nan() -> None:
    assert math.isnan(roc_auc(score_histogram(np.array([0.1, 0.4]), np.array([True, True]))))


def test_shard_bounds_are_unequal_for_1000_over_3() -> None:
    assert [b - a for a, b in shard_bounds(1000, 3)] == [334, 333, 333]


def test_the_evaluation_table_shows_a_metric_once_when_the_report_repeats_it():
    """The compiled metric ``accuracy`` and the classifier report's ``accuracy`` are one row; the report's
    other averages follow, then the samples."""
    from nbdist.ui.report import metric_rows

    result = {"loss": 0.25, "accuracy": 0.9, "samples": 10, "averages": {"accuracy": 0.9, "macro_f1": 0.8}}
    assert [name for name, _ in metric_rows(result)] == ["loss", "accuracy", "macro_f1", "samples"]
