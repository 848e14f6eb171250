"""Pure logic: configuration, sharding, the averaging schedule, metric merging. Milliseconds."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from nbdist.config import TrainConfig
from nbdist.data.inputs import make_fit_data
from nbdist.data.sharding import shard_bounds
from nbdist.driver.state import RunState, merge_epoch_logs
from nbdist.errors import NbdistError
from nbdist.strategies.averaging import batch_sizes, rounds_per_epoch, sync_after
from nbdist.wire.reports import Epoch


def test_shards_cover_everything_and_differ_by_at_most_one():
    for n in (1, 7, 100, 1797):
        for k in range(1, min(n, 9) + 1):
            bounds = shard_bounds(n, k)
            sizes = [b - a for a, b in bounds]
            assert sum(sizes) == n and max(sizes) - min(sizes) <= 1
            assert all(bounds[i][1] == bounds[i + 1][0] for i in range(k - 1))


def test_rounds_pad_uneven_shards_to_the_longest():
    # 57 and 56 batches with K=5: 12 rounds each, the last one at each worker's final batch.
    assert rounds_per_epoch([57, 56], 5) == 12
    syncs = [b for b in range(56) if sync_after(b, 56, 5)]
    assert syncs[-1] == 55 and len(syncs) == 12
    assert batch_sizes(899, 16)[-1] == 3 and sum(batch_sizes(899, 16)) == 899


def test_epoch_metrics_are_weighted_by_samples():
    merged = merge_epoch_logs([
        {"logs": {"loss": 1.0, "val_loss": 4.0}, "samples": 300, "val_samples": 10},
        {"logs": {"loss": 2.0, "val_loss": 1.0}, "samples": 100, "val_samples": 30},
    ])
    assert merged["loss"] == pytest.approx(1.25)
    assert merged["val_loss"] == pytest.approx(1.75)


def test_run_state_builds_history_once_every_worker_reported():
    st = RunState(world_size=2, epochs=3)
    body = Epoch(epoch=0, logs={"loss": 1.0}, samples=10, val_samples=0, seconds=0.5)
    assert st.worker_epoch(0, body) is None
    assert st.history == {}
    assert st.worker_epoch(1, dataclasses.replace(body, logs={"loss": 3.0})) == {"loss": 2.0}
    assert st.history == {"loss": [2.0]} and st.epochs_done == 1
    assert st.throughput == pytest.approx(40.0)


@pytest.mark.parametrize("options, fragment", [
    ({"workers": 0}, "workers must be a whole number"),
    ({"epochs": -1}, "epochs must be"),
    ({"batch_size": 2.5}, "batch_size must be"),
    ({"strategy": "magic"}, "unknown strategy"),
    ({"backend": "cloud"}, "unknown backend"),
    ({"ui": "fancy"}, "unknown ui"),
    ({"averaging_frequency": 0}, "averaging_frequency"),
    ({"seed": -3}, "seed"),
    ({"direct_sum_bytes": -1}, "direct_sum_bytes must be a non-negative number of bytes"),
    ({"shared_memory": "yes"}, "shared_memory must be True or False"),
    ({"local_share": 0}, "local_share must be a whole number of at least 1"),
    ({"local_share": 2, "local_slot": 2}, r"local_slot must be a whole number from 0 to local_share - 1 \(1\)"),
    ({"warm_workers": "0"}, "warm_workers must be True or False, got '0'"),
    ({"phase_times": 1}, "phase_times must be True or False"),
    ({"executor_wait": -1}, r"executor_wait must be a number of seconds of at least 0, got -1; for example"),
    ({"executor_wait": "60"}, "executor_wait must be a number of seconds"),
    ({"advertise_host": "10.0.0.5 "}, "advertise_host must be an address of this machine that the Spark executors"),
    ({"container_engine": ""}, "container_engine must name the podman or docker binary"),
])
def test_bad_options_get_one_sentence(options, fragment):
    with pytest.raises(NbdistError, match=fragment) as info:
        TrainConfig(**options)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("x, y, fragment", [
    (np.zeros((5, 2)), np.zeros(4), "x has 5 rows but y has 4 rows"),
    (np.array([["2020-01-01", "2020-01-02"]], dtype="datetime64[D]"), np.zeros(1), "not numbers"),
    (np.array([["a", 1]], dtype=object), np.zeros(1), "not numbers"),
    (np.zeros((0, 3)), np.zeros(0), "empty"),
    (3.0, None, "single value"),
])
def test_bad_data_gets_one_sentence(x, y, fragment):
    with pytest.raises(NbdistError, match=fragment):
        make_fit_data(x, y)


def test_nan_data_trains_as_in_keras_with_one_warning_line(caplog):
    """Issue 46: Keras trains on NaN features and labels; nbdist does too and says so in one line."""
    with caplog.at_level("WARNING", logger="nbdist.data.inputs"):
        data = make_fit_data(np.array([[1.0, np.nan], [np.inf, 0.0]]), np.array([0.0, np.nan]))
    assert len(data) == 2
    assert [r.getMessage().count("\n") for r in caplog.records] == [0]
    assert "the features 2, the labels 1" in caplog.text


def test_pandas_and_lists_are_accepted():
    pd = pytest.importorskip("pandas")
    ds = make_fit_data(pd.DataFrame({"a": [1.0, 2.0], "b": [3.0, 4.0]}), pd.Series([0, 1]))
    assert ds.x.shape == (2, 2) and ds.x.dtype == np.float32 and len(ds) == 2
    assert make_fit_data([[1, 2], [3, 4]], [0, 1]).x.shape == (2, 2)


def test_lr_scaling_keeps_plain_sgd_exact_and_scales_adaptive_optimizers():
    from nbdist.strategies.lr_scaling import lr_scale_factor

    assert lr_scale_factor("auto", "SGD", 4) == 1.0
    assert lr_scale_factor("auto", "Adam", 4) == 4.0
    assert lr_scale_factor("linear", "SGD", 3) == 3.0
    assert lr_scale_factor("none", "Adam", 3) == 1.0
    assert lr_scale_factor("auto", "Adam", 1) == 1.0


def test_last_traceback_keeps_the_head_of_a_long_traceback() -> None:
    from nbdist.driver.failures import last_traceback

    frames = "\n".join(f'  File "x.py", line {i}, in f' for i in range(300))
    log = f"INFO starting\nTraceback (most recent call last):\n  old\nValueError: first\n" \
          f"INFO more\nTraceback (most recent call last):\n{frames}\nValueError: boom"
    got = last_traceback(log)
    assert got.startswith("Traceback (most recent call last):\n  File") and got.endswith("ValueError: boom")
    assert "first" not in got
    assert last_traceback("\n".join(str(i) for i in range(100))).splitlines() == [str(i) for i in range(70, 100)]


@pytest.mark.parametrize("value", [np.array([["a"], ["b"]]), ["one text", "another"], np.array([b"x", b"y"]),
                                   np.array(["a", "b"], dtype=object)])
def test_text_inputs_are_data_as_keras_takes_them(value):
    """Strings for a model's own StringLookup or TextVectorization: fixed-width arrays that cross the wire."""
    from nbdist.data.inputs import make_fit_data
    from nbdist.data.structures import to_struct

    for arr in (make_fit_data(value).x, to_struct(value, "x")):
        assert arr.dtype.kind in "US" and len(arr) == 2


def test_text_for_an_input_that_takes_numbers_is_one_sentence_before_launch():
    import keras

    from nbdist.checks import check_text_inputs

    a, b = keras.Input((1,), name="a"), keras.Input((1,), name="b", dtype="string")
    model = keras.Model({"a": a, "b": b}, keras.layers.Dense(1)(a))
    text = np.array([["x"], ["y"]])
    check_text_inputs(model, {"a": np.zeros((2, 1), "float32"), "b": text})  # text where it is taken
    with pytest.raises(NbdistError, match=r"'a' hold text \(dtype <U1\) but the model's input takes float32"):
        check_text_inputs(model, {"a": text, "b": text})
