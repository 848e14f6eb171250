"""Side-by-side runs for the Keras conformance suite (tests/workers/test_keras_conformance.py).

A cell runs twice in the shared IPython shell: as it is, and as the cell of ``%%dist_train`` (2 local
workers, allreduce, so an unshuffled fit takes the local steps). ``Side`` keeps what a user could
compare: the History, the weights, the hooks a recording callback saw (name, index, logs, a fingerprint
of the weights ``self.model`` held), the exception the cell's own ``except`` caught, the warnings
and nbdist log lines, and the files written under the run's ``OUT`` folder.
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

MAGIC_LINE = "--workers 2 --ui none --strategy allreduce"
EPOCH_HOOKS = ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end")
TEST_HOOKS = ("on_test_begin", "on_test_end")
BATCH_HOOKS = ("on_train_batch_begin", "on_train_batch_end", "on_test_batch_begin", "on_test_batch_end")


def fingerprint(model: Any) -> float:
    return float(sum(np.abs(np.asarray(w, dtype="float64")).sum() for w in model.get_weights()))


def plain_logs(logs: dict | None) -> dict[str, Any]:
    return {k: np.asarray(v, dtype="float64").tolist() for k, v in sorted((logs or {}).items())}


def _recorder_class() -> type:
    import keras

    class HookRecorder(keras.callbacks.Callback):
        """Records every hook Keras calls: (hook, epoch or batch index or None, logs, weights' fingerprint)."""

        def __init__(self) -> None:
            super().__init__()
            self.events: list[tuple[str, int | None, dict[str, Any], float | None]] = []

        def _record(self, hook: str, index: int | None, logs: dict | None, weights: bool = True) -> None:
            self.events.append((hook, index, plain_logs(logs), fingerprint(self.model) if weights else None))

        def on_train_begin(self, logs=None):
            self._record("on_train_begin", None, logs)

        def on_train_end(self, logs=None):
            self._record("on_train_end", None, logs)

        def on_epoch_begin(self, epoch, logs=None):
            self._record("on_epoch_begin", epoch, logs)

        def on_epoch_end(self, epoch, logs=None):
            self._record("on_epoch_end", epoch, logs)

        def on_test_begin(self, logs=None):
            self._record("on_test_begin", None, logs)

        def on_test_end(self, logs=None):
            self._record("on_test_end", None, logs)

        def on_train_batch_end(self, batch, logs=None):
            self._record("on_train_batch_end", batch, logs, weights=False)

        def on_test_batch_end(self, batch, logs=None):
            self._record("on_test_batch_end", batch, logs, weights=False)

    return HookRecorder


_RECORDER: type | None = None


def HookRecorder() -> Any:
    global _RECORDER
    if _RECORDER is None:
        _RECORDER = _recorder_class()
    return _RECORDER()


@dataclass
class Side:
    ns: dict[str, Any]
    history: dict[str, list[float]] | None
    epochs: list[int] | None
    weights: list[np.ndarray] | None
    events: list[tuple] = field(default_factory=list)
    caught: BaseException | None = None  # what the cell's own `except` caught
    raised: BaseException | None = None  # what running the cell (or the magic) raised
    said: list[str] = field(default_factory=list)  # warnings and nbdist's log lines
    out: Path | None = None

    def hooks(self, names: tuple[str, ...]) -> list[tuple]:
        return [e for e in self.events if e[0] in names]

    def files(self) -> list[str]:
        assert self.out is not None
        return sorted(str(p.relative_to(self.out)) for p in self.out.rglob("*") if p.is_file())


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


CELL_NAMES = ("hist", "model", "rec", "caught", "result")


def run_cell(ip: Any, cell: str, out: Path, magic: bool, line: str = MAGIC_LINE, **names: Any) -> Side:
    """Run ``cell`` locally or under ``%%dist_train`` with ``OUT`` (a fresh folder) and ``names`` set."""
    out.mkdir(parents=True, exist_ok=True)
    ns = ip.user_ns
    for name in CELL_NAMES:
        ns.pop(name, None)
    ns.update(OUT=str(out), **names)
    lines = _Lines()
    logger = logging.getLogger("nbdist")
    logger.addHandler(lines)
    raised = None
    with warnings.catch_warnings(record=True) as caught_warnings:
        warnings.simplefilter("always")
        try:
            if magic:
                ip.run_cell_magic("dist_train", line, cell)
            else:
                result = ip.run_cell(cell)
                if result.error_in_exec is not None:
                    raised = result.error_in_exec
        except Exception as exc:
            raised = exc
        finally:
            logger.removeHandler(lines)
    hist, model, rec = ns.get("hist"), ns.get("model"), ns.get("rec")
    return Side(
        ns=dict(ns), history=dict(hist.history) if hist is not None else None,
        epochs=list(hist.epoch) if hist is not None else None,
        weights=model.get_weights() if model is not None else None,
        events=list(rec.events) if rec is not None else [], caught=ns.get("caught"), raised=raised,
        said=[str(w.message) for w in caught_warnings] + lines.lines, out=out)


def side_by_side(ip: Any, cell: str, out: Path, line: str = MAGIC_LINE, **names: Any) -> tuple[Side, Side]:
    return (run_cell(ip, cell, out / "local", False, line, **names),
            run_cell(ip, cell, out / "nbdist", True, line, **names))


def assert_same_history(got: Side, expected: Side, rtol: float = 1e-5) -> None:
    assert got.history is not None, f"no History under nbdist (raised {got.raised!r}, caught {got.caught!r})"
    assert expected.history is not None
    assert sorted(got.history) == sorted(expected.history), (sorted(got.history), sorted(expected.history))
    for key, values in expected.history.items():
        np.testing.assert_allclose(np.asarray(got.history[key], "float64"), np.asarray(values, "float64"),
                                   rtol=rtol, atol=1e-7, err_msg=key)
    assert got.epochs == expected.epochs


def assert_same_weights(got: Side, expected: Side, rtol: float = 1e-5) -> None:
    assert got.weights is not None and expected.weights is not None
    for a, b in zip(got.weights, expected.weights, strict=True):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-6)


def assert_same_events(got: list[tuple], expected: list[tuple], rtol: float = 1e-5) -> None:
    """The same hooks in the same order with the same indices, logs and weights in ``self.model``."""
    assert [e[:2] for e in got] == [e[:2] for e in expected]
    for (hook, index, logs, weights), (_, _, want_logs, want_weights) in zip(got, expected, strict=True):
        assert sorted(logs) == sorted(want_logs), (hook, index, sorted(logs), sorted(want_logs))
        for key, value in want_logs.items():
            np.testing.assert_allclose(logs[key], value, rtol=rtol, atol=1e-7, err_msg=f"{hook}({index}) {key}")
        if want_weights is not None:
            assert weights == pytest_approx(want_weights, rtol), (hook, index, weights, want_weights)


def pytest_approx(value: float, rtol: float) -> Any:
    import pytest

    return pytest.approx(value, rel=rtol)


def same_exception(got: BaseException | None, expected: BaseException | None) -> None:
    """The same type and the same message (its first line) as Keras'."""
    assert expected is not None, "the local run raised nothing; the test needs it to"
    assert got is not None, f"nothing raised under nbdist (expected {type(expected).__name__}: {expected})"
    assert type(got) is type(expected), f"{type(got).__name__}: {got}  (Keras: {type(expected).__name__})"
    first = str(expected).strip().splitlines()[0]
    assert str(got).strip().splitlines()[0] == first, (str(got), first)


def tensorboard_tags(run_dir: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    tags = acc.Tags()
    return set(tags.get("tensors", [])) | set(tags.get("scalars", []))
