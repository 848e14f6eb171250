"""Exact evaluation from per-shard sufficient statistics (pure numpy, no Keras).

A shard never reports a score such as AUC or F1: averaging those over shards is
wrong. It reports state that adds up — Keras metric variables (totals, counts,
thresholded TP/FP/TN/FN), a confusion matrix, and for binary classifiers a
histogram of (score, positives, negatives) — and the driver sums the state and
computes every score once, from the whole.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import NbdistError

_BINARY_LOSSES = {"binarycrossentropy", "binaryfocalcrossentropy"}
_ONE_HOT_LOSSES = {"categoricalcrossentropy", "categoricalfocalcrossentropy", "categoricalhinge"}
_SPARSE_LOSSES = {"sparsecategoricalcrossentropy"}
_KERAS_LOSS_FUNCTIONS = _BINARY_LOSSES | _ONE_HOT_LOSSES | _SPARSE_LOSSES | {
    "meansquarederror", "meanabsoluteerror", "meanabsolutepercentageerror", "meansquaredlogarithmicerror",
    "mse", "mae", "mape", "msle", "huber", "logcosh", "hinge", "squaredhinge", "kldivergence", "kld",
    "poisson", "cosinesimilarity"}


@dataclass(frozen=True)
class ClassifierSpec:
    """How to turn a model's outputs and labels into class ids."""

    kind: str  # "binary" | "multiclass"
    classes: int
    sparse_labels: bool  # multiclass: integer labels rather than one-hot rows
    threshold: float  # binary: predicted positive when score > threshold

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "classes": self.classes, "sparse_labels": self.sparse_labels,
                "threshold": self.threshold}

    @classmethod
    def from_json(cls, d: dict[str, Any] | None) -> ClassifierSpec | None:
        if not d:
            return None
        return cls(str(d["kind"]), int(d["classes"]), bool(d["sparse_labels"]), float(d["threshold"]))


# -- what kind of model is this ----------------------------------------------
def compiled_loss(model: Any) -> Any:
    """The loss ``model.compile`` was given, described as ``model.get_compile_config()["loss"]`` describes it
    (a name, or a dict with module, class_name and config), without Keras' serializer: that imports
    TensorFlow whenever it is installed (it checks for TensorFlow types), even on the JAX and torch backends."""
    compiled = getattr(model, "_compile_config", None)
    config = getattr(compiled, "config", None)
    if not isinstance(config, dict):  # not compiled, or a Keras without this attribute: its own answer
        get = getattr(model, "get_compile_config", None)
        return (get() or {}).get("loss") if callable(get) else None
    return _describe_loss(config.get("loss"))


def _describe_loss(loss: Any) -> Any:
    if loss is None or isinstance(loss, str):
        return loss
    if isinstance(loss, (list, tuple)):
        return [_describe_loss(item) for item in loss]
    if isinstance(loss, dict):
        return {key: _describe_loss(item) for key, item in loss.items()}
    if callable(loss) and not hasattr(loss, "get_config"):  # a plain function, as Keras writes one
        return {"module": "builtins", "class_name": "function", "config": getattr(loss, "__name__", "")}
    fn_kwargs = getattr(loss, "_fn_kwargs", None) or {}  # Keras' loss classes keep from_logits there
    return {"module": type(loss).__module__, "class_name": type(loss).__name__,
            "config": {"name": getattr(loss, "name", None),
                       "from_logits": bool(fn_kwargs.get("from_logits", getattr(loss, "from_logits", False)))}}


def loss_identity(loss: Any) -> tuple[str | None, bool]:
    """Normalised loss name and from_logits flag, from a compile config's ``loss`` entry."""
    if isinstance(loss, str):
        return _norm(loss), False
    if isinstance(loss, dict):
        cfg = loss.get("config")
        if isinstance(cfg, str):  # a plain function: {"class_name": "function", "config": "name"}
            return _norm(cfg), False
        if isinstance(cfg, dict):
            name = loss.get("class_name") or cfg.get("name") or ""
            return _norm(str(name)), bool(cfg.get("from_logits", False))
    return None, False  # lists/dicts of losses (multi-output) or unknown: no classifier report


def _norm(name: str) -> str:
    return name.split(">")[-1].split(".")[-1].replace("_", "").lower()


def classifier_spec(loss: Any, output_shape: Sequence[int | None]) -> ClassifierSpec | None:
    """The classifier a model is, judged by its loss and output shape; None for anything else."""
    name, logits = loss_identity(loss)
    if name is None or len(output_shape) != 2:
        return None
    width = output_shape[-1]
    if width is None:
        return None
    if name in _BINARY_LOSSES and width == 1:
        return ClassifierSpec("binary", 2, True, 0.0 if logits else 0.5)
    if name in _SPARSE_LOSSES and width >= 2:
        return ClassifierSpec("multiclass", int(width), True, 0.5)
    if name in _ONE_HOT_LOSSES and width >= 2:
        return ClassifierSpec("multiclass", int(width), False, 0.5)
    return None


def check_labels(y_shape: Sequence[int], output_shape: Sequence[int | None], loss: Any, what: str = "labels") -> None:
    """One sentence if the labels cannot be the targets of this model's output."""
    name, _ = loss_identity(loss)
    row = tuple(int(d) for d in y_shape[1:])
    out = tuple(output_shape[1:])
    if any(d is None for d in out):
        return  # variable-size outputs: let Keras judge
    out_size = int(np.prod(out)) if out else 1
    row_size = int(np.prod(row)) if row else 1
    if name in _SPARSE_LOSSES:
        if row_size != 1:
            raise NbdistError(
                f"{what} have shape {row} per row but sparse_categorical_crossentropy expects one "
                f"integer class per row; pass y as a vector of class ids (e.g. y.argmax(axis=1) for one-hot rows)."
            )
        return
    if not _keras_loss(loss):
        return  # the notebook's own loss may map any labels to any outputs: local fit judges, so do we not
    if row_size != out_size:
        hint = ""
        if name in _ONE_HOT_LOSSES and row_size == 1:
            hint = " (integer class ids need loss='sparse_categorical_crossentropy', or one-hot encode y)"
        raise NbdistError(
            f"{what} have shape {row or '()'} per row but the model outputs {out} per row{hint}; "
            "pass labels that match the model's output."
        )


def _keras_loss(loss: Any) -> bool:
    """A loss Keras ships (by name or as its own object), whose label shape it fixes."""
    if isinstance(loss, str):
        return True
    if not isinstance(loss, dict):
        return False
    if loss.get("class_name") == "function":  # Keras writes module "builtins" for every function: judge by name
        return _norm(str(loss.get("config"))) in _KERAS_LOSS_FUNCTIONS
    return str(loss.get("module") or "").startswith("keras")


def labels_are_classes(y: np.ndarray, spec: ClassifierSpec) -> bool:
    """Whether the labels are hard class labels the report can count (not soft targets)."""
    if spec.kind == "multiclass" and not spec.sparse_labels:
        return bool(np.all((y == 0) | (y == 1)) and np.all(y.reshape(len(y), -1).sum(axis=1) == 1))
    flat = np.asarray(y).reshape(-1)
    return bool(np.all(flat == np.round(flat)) and np.all((flat >= 0) & (flat < spec.classes)))


# -- per-shard statistics ----------------------------------------------------
def class_ids(y: np.ndarray, y_pred: np.ndarray, spec: ClassifierSpec) -> tuple[np.ndarray, np.ndarray]:
    """True and predicted class ids, the way Keras's accuracy/precision/recall see them."""
    n = len(y_pred)
    if spec.kind == "binary":
        scores = np.asarray(y_pred).reshape(n)
        return np.asarray(y).reshape(n).astype(np.int64), (scores > spec.threshold).astype(np.int64)
    pred = np.asarray(y_pred).reshape(n, -1).argmax(axis=1)
    true = np.asarray(y).reshape(n) if spec.sparse_labels else np.asarray(y).reshape(n, -1).argmax(axis=1)
    return true.astype(np.int64), pred.astype(np.int64)


def confusion_counts(true: np.ndarray, pred: np.ndarray, classes: int) -> np.ndarray:
    """classes x classes counts: row = true class, column = predicted class (sklearn's layout)."""
    if len(true) and (true.min() < 0 or true.max() >= classes):
        raise NbdistError(f"labels hold class ids outside 0..{classes - 1}, but the model has {classes} "
                          "outputs; check the labels or the model's last layer.")
    flat = np.bincount(true * classes + pred, minlength=classes * classes)
    return flat.reshape(classes, classes).astype(np.int64)


def score_histogram(scores: np.ndarray, positive: np.ndarray) -> np.ndarray:
    """Rows (score, positives, negatives) for each distinct score: exact ROC state, mergeable."""
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    positive = np.asarray(positive).reshape(-1).astype(bool)
    values, inverse = np.unique(scores, return_inverse=True)
    pos = np.bincount(inverse, weights=positive, minlength=len(values))
    neg = np.bincount(inverse, weights=~positive, minlength=len(values))
    return np.stack([values, pos, neg], axis=1)


def shard_statistics(y: np.ndarray, y_pred: np.ndarray, spec: ClassifierSpec) -> dict[str, np.ndarray] | None:
    """A shard's additive classifier state, or None when its labels are not hard classes."""
    if not labels_are_classes(y, spec):
        return None
    true, pred = class_ids(y, y_pred, spec)
    out = {"confusion": confusion_counts(true, pred, spec.classes)}
    if spec.kind == "binary":
        out["histogram"] = score_histogram(np.asarray(y_pred).reshape(-1), true == 1)
    return out


# -- merging -----------------------------------------------------------------
def sum_states(states: Sequence[Sequence[np.ndarray]]) -> list[np.ndarray]:
    """Element-wise sum of each variable over shards, in float64 so the sum itself loses nothing."""
    if not states:
        raise ValueError("no shard states to merge")
    shapes = [tuple(np.shape(a) for a in s) for s in states]
    if any(s != shapes[0] for s in shapes):
        raise NbdistError("workers reported metric state of different shapes; every worker must "
                          "run the same model version — rerun the evaluation.")
    return [np.sum([np.asarray(s[i], dtype=np.float64) for s in states], axis=0) for i in range(len(states[0]))]


def merge_histograms(histograms: Sequence[np.ndarray]) -> np.ndarray:
    stacked = np.concatenate([h for h in histograms if len(h)], axis=0)
    values, inverse = np.unique(stacked[:, 0], return_inverse=True)
    pos = np.bincount(inverse, weights=stacked[:, 1], minlength=len(values))
    neg = np.bincount(inverse, weights=stacked[:, 2], minlength=len(values))
    return np.stack([values, pos, neg], axis=1)


def roc_auc(histogram: np.ndarray) -> float:
    """Exact area under the ROC curve (ties handled as sklearn does); NaN with one class only."""
    order = np.argsort(-histogram[:, 0], kind="stable")
    pos, neg = histogram[order, 1], histogram[order, 2]
    p, n = pos.sum(), neg.sum()
    if p == 0 or n == 0:
        return math.nan
    tpr = np.concatenate([[0.0], np.cumsum(pos) / p])
    fpr = np.concatenate([[0.0], np.cumsum(neg) / n])
    return float(np.sum((fpr[1:] - fpr[:-1]) * (tpr[1:] + tpr[:-1]) / 2.0))


def _safe_div(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    num, den = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    return np.divide(num, den, out=np.zeros_like(num), where=den > 0)


def classification_report(confusion: np.ndarray) -> tuple[dict[int, dict[str, float]], dict[str, float]]:
    """Per-class precision/recall/F1/support and their averages, from summed confusion counts.

    A class never predicted (or never present) scores 0, like sklearn's zero_division=0.
    """
    cm = np.asarray(confusion, dtype=np.float64)
    tp = np.diag(cm)
    predicted, actual = cm.sum(axis=0), cm.sum(axis=1)
    precision = _safe_div(tp, predicted)
    recall = _safe_div(tp, actual)
    f1 = _safe_div(2 * tp, predicted + actual)
    total = cm.sum()
    per_class = {i: {"precision": float(precision[i]), "recall": float(recall[i]), "f1": float(f1[i]),
                     "support": int(actual[i])} for i in range(len(cm))}
    weights = actual / total if total else np.zeros_like(actual)
    averages = {
        "accuracy": float(tp.sum() / total) if total else math.nan,
        "macro_precision": float(precision.mean()),
        "macro_recall": float(recall.mean()),
        "macro_f1": float(f1.mean()),
        "weighted_f1": float((f1 * weights).sum()),
    }
    return per_class, averages


def merge_classifier_stats(shards: Sequence[dict[str, np.ndarray] | None],
                           spec: ClassifierSpec) -> dict[str, Any] | None:
    """The classifier part of the result, or None if any shard could not count classes."""
    if not shards or any(s is None for s in shards):
        return None
    confusion = np.sum([s["confusion"] for s in shards], axis=0).astype(np.int64)
    per_class, averages = classification_report(confusion)
    if spec.kind == "binary":
        # For a binary classifier the headline precision/recall/F1 are those of the positive class.
        averages.update({"precision": per_class[1]["precision"], "recall": per_class[1]["recall"],
                         "f1": per_class[1]["f1"],
                         "roc_auc": roc_auc(merge_histograms([s["histogram"] for s in shards]))})
    return {"kind": spec.kind, "confusion_matrix": confusion, "per_class": per_class, "averages": averages}
