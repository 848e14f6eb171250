"""One data path (issue 24, item 3): ``--data X,y`` is ``model.fit(X, y)``, and ``%dist_evaluate`` /
``%dist_predict`` take what ``model.evaluate`` / ``model.predict`` take (issue 30, point 5).

A two-input, two-output model on digits (the image, and its left half as a second input; the digit and
its parity as outputs), with its data as dicts or as lists, on 2 real worker processes.
"""
from __future__ import annotations

import numpy as np
import pytest

import nbdist

from ..conftest import worker_processes

CELL = """
import keras
keras.utils.set_random_seed(3)
pixels, half = keras.Input((64,), name="pixels"), keras.Input((32,), name="half")
h = keras.layers.Dense(16, activation="relu")(keras.layers.Concatenate()([pixels, half]))
digit = keras.layers.Dense(10, activation="softmax", name="digit")(h)
parity = keras.layers.Dense(1, activation="sigmoid", name="parity")(h)
model = keras.Model(INPUTS, OUTPUTS)
model.compile(keras.optimizers.SGD(0.1), loss=LOSSES, loss_weights=WEIGHTS,
              metrics=METRICS)
"""
FORMS = {
    "dict": {"INPUTS": '{"pixels": pixels, "half": half}', "OUTPUTS": '{"digit": digit, "parity": parity}',
             "LOSSES": '{"digit": "sparse_categorical_crossentropy", "parity": "binary_crossentropy"}',
             "WEIGHTS": '{"digit": 1.0, "parity": 0.5}', "METRICS": '{"digit": ["accuracy"], "parity": ["mae"]}'},
    "list": {"INPUTS": "[pixels, half]", "OUTPUTS": "[digit, parity]",
             "LOSSES": '["sparse_categorical_crossentropy", "binary_crossentropy"]', "WEIGHTS": "[1.0, 0.5]",
             "METRICS": '[["accuracy"], ["mae"]]'},
}


def cell(form: str) -> str:
    text = CELL
    for name, value in FORMS[form].items():
        text = text.replace(name, value)
    return text


def data(x: np.ndarray, y: np.ndarray, form: str) -> tuple[object, object]:
    inputs = {"pixels": x, "half": np.ascontiguousarray(x[:, :32])}
    targets = {"digit": y, "parity": (y % 2).astype("float32")[:, None]}
    if form == "list":
        return list(inputs.values()), list(targets.values())
    return inputs, targets


def test_data_line_with_several_inputs_and_outputs_trains_as_the_cells_own_fit(ip, digits):
    """``--data X,Y`` with dicts of inputs and of labels, and with lists of them, trains exactly as the
    same cell's ``model.fit(X, Y)`` under the magic (the same global batch, seed and workers): it is that call."""
    x, y = digits
    line = "--workers 2 --strategy allreduce --epochs 1 --seed 0 --ui none"
    ns = ip.user_ns
    ns["Xf"], ns["Yf"] = data(x[:600], y[:600], "dict")
    ip.run_cell_magic("dist_train", line + " --out by_fit", cell("dict") + "model.fit(Xf, Yf, batch_size=64)\n")
    by_fit = ns["model"]
    for form in FORMS:
        ns["Xf"], ns["Yf"] = data(x[:600], y[:600], form)
        ip.run_cell_magic("dist_train", f"--data Xf,Yf --batch-size 32 {line} --out by_data", cell(form))
        by_data = ns["model"]
        assert by_data is not by_fit and by_data.optimizer.iterations.numpy() == 10  # global batches of 64
        for a, b in zip(by_data.get_weights(), by_fit.get_weights()):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
        for name, values in ns["by_fit"].items():
            renamed = name if form == "dict" or name == "loss" else name.replace("digit", "output_0")
            assert ns["by_data"].get(renamed, ns["by_data"].get(name)) == pytest.approx(values, abs=1e-6), name
    assert not worker_processes()


def test_evaluate_and_predict_take_what_keras_takes(ip, digits):
    """Several inputs and outputs as dicts and as lists, and sample weights per output, on 2 workers: what
    the local ``model.evaluate(..., return_dict=True)`` and ``model.predict`` return, to 1e-5."""
    x, y = digits
    ns = ip.user_ns
    weights = np.linspace(0.2, 2.0, 301).astype("float32")
    for form, api_evaluates in (("dict", True), ("list", False)):
        ip.run_cell(cell(form))
        model = ns["model"]
        xt, yt = data(x[:300], y[:300], form)
        model.fit(xt, yt, epochs=1, batch_size=32, verbose=0)  # trained weights (evaluate warns otherwise)
        xe, ye = data(x[1000:1301], y[1000:1301], form)  # 301 rows: 5 batches of 64, 3 on one worker, 2 on the other
        w = {"digit": weights, "parity": weights[::-1].copy()}
        w = list(w.values()) if form == "list" else w
        want = model.evaluate(xe, ye, sample_weight=w, batch_size=64, verbose=0, return_dict=True)
        assert abs(model.evaluate(xe, ye, verbose=0, return_dict=True)["loss"] - want["loss"]) > 1e-3  # weights count
        ns.update(m2=model, Xe=xe, Ye=ye, We=w)
        if api_evaluates:
            got = nbdist.evaluate(model, xe, ye, sample_weight=w, workers=2, batch_size=64)
            ip.run_line_magic("dist_predict", "m2 --data Xe --workers 2 --out pe")
            remote = ns["pe"]
        else:
            line = "m2 --data Xe,Ye --sample-weight We --workers 2 --batch-size 64 --out ee"
            ip.run_line_magic("dist_evaluate", line)
            got = ns["ee"]
            remote = nbdist.predict(model, xe, workers=2)
        assert set(want) <= set(got) and got["samples"] == 301
        for name, value in want.items():
            assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-5), (form, name)
        local = model.predict(xe, verbose=0)
        assert type(remote) is type(local) and len(remote) == 2
        for key in (local if isinstance(local, dict) else range(2)):
            np.testing.assert_allclose(remote[key], local[key], rtol=0, atol=1e-5)
    assert not worker_processes()


def test_a_dealt_memory_map_reads_its_rows_from_the_file(tmp_path):
    """A local worker's dealt rows of a memory-mapped .npy (every global batch split over the workers)
    are read from the file: the rows ``deal_rows`` gives that rank, in that order."""
    from nbdist.data.inputs import make_fit_data
    from nbdist.data.sharding import deal_rows
    from nbdist.wire.shardfile import NpyRows

    x = np.arange(23 * 3, dtype=np.float32).reshape(23, 3)
    np.save(tmp_path / "x.npy", x)
    data = make_fit_data(np.load(tmp_path / "x.npy", mmap_mode="r"), np.arange(23))
    assert isinstance(data.x, np.memmap)  # not copied into memory
    rows = deal_rows(23, 7, 2)[1]  # 3 of every 7 rows, then its part of the last 2
    reader = NpyRows(data.x_file.dealt(7, 2, 1), np.arange(23)[rows])
    got = [reader.block(i) for i in range(reader.blocks)]
    reader.close()
    np.testing.assert_array_equal(np.concatenate([g[0] for g in got]), x[rows])
    assert np.concatenate([g[1] for g in got]).tolist() == rows.tolist()
