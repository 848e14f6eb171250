"""The notebook's memory-mapped .npy reaches local workers as the file itself: each reads its rows."""
from __future__ import annotations

import numpy as np
import pytest

import nbdist

from ..conftest import mlp


@pytest.fixture
def sent(monkeypatch):
    """The training jobs as the workers got them, by rank (a finished run keeps no data to make them again)."""
    from nbdist.driver.training import TrainingJob

    jobs: dict[int, object] = {}
    made = TrainingJob._job_message
    monkeypatch.setattr(TrainingJob, "_job_message", lambda self, rank: jobs.setdefault(rank, made(self, rank)))
    return jobs


@pytest.mark.parametrize("strategy", ["allreduce", "averaging"])
def test_a_memory_map_trains_as_the_array_in_memory(digits, tmp_path, strategy, sent, no_leftover_workers):
    X, y = digits
    np.save(tmp_path / "x.npy", X[:1000].astype("float64"))  # cast per block on the workers
    mapped = np.load(tmp_path / "x.npy", mmap_mode="r")
    options = dict(epochs=2, batch_size=32, workers=2, strategy=strategy, averaging_frequency=1, shuffle=False,
                   stream_buffer_bytes=100 * 64 * 4, ui="none")  # windows of ~100 rows, 4 MB blocks
    from_file, in_memory = mlp(), mlp()
    nbdist.train(from_file, mapped, y[:1000], **options)
    first = sent[1]  # what worker 1 was sent
    nbdist.train(in_memory, X[:1000], y[:1000], **options)
    # its dealt rows of every global batch of 64 (nbdist.train is model.fit(x, y)): 32..63, 96..127, ...
    assert first.data_source == "file" and first.x is None and first.data_file["deal"] == [1000, 64, 2, 1]
    for a, b in zip(from_file.get_weights(), in_memory.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_evaluate_and_predict_read_a_memory_map_from_the_file(digits, tmp_path, no_leftover_workers):
    """%dist_evaluate / %dist_predict on a memory map: local workers read their rows from the file (none
    cross the wire), in batches of the whole pass; the results are the local evaluate's and predict's."""
    from nbdist.driver.inference import EvaluationJob, PredictionJob
    from nbdist.inference_api import inference_request

    X, y = digits
    np.save(tmp_path / "x.npy", X[:301].astype("float64"))
    mapped = np.load(tmp_path / "x.npy", mmap_mode="r")
    model = mlp()
    model.fit(X[:300], y[:300], epochs=1, verbose=0)
    config, data = inference_request(model, mapped, y[:301], None, True, {"workers": 2, "batch_size": 64}, "the model")
    job = EvaluationJob(model, config, data)
    got = job.run()
    sent = job._job_message(1)
    assert sent.data_source == "file" and sent.x is None
    assert (sent.data_file["start"], sent.data_file["stop"]) == (192, 301)  # batches 3 and 4 of 64
    want = model.evaluate(X[:301], y[:301], batch_size=64, verbose=0, return_dict=True)
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-5), name
    config, data = inference_request(model, mapped, None, None, False, {"workers": 2, "batch_size": 64}, "the model")
    predicted = PredictionJob(model, config, data).run()
    np.testing.assert_allclose(predicted, model.predict(X[:301], verbose=0), rtol=0, atol=1e-5)


def two_input_model():
    import keras

    keras.utils.set_random_seed(3)
    pixels, half = keras.Input((64,), name="pixels"), keras.Input((32,), name="half")
    h = keras.layers.Dense(16, activation="relu")(keras.layers.Concatenate()([pixels, half]))
    model = keras.Model({"pixels": pixels, "half": half}, keras.layers.Dense(10, activation="softmax")(h))
    model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def test_a_memory_map_among_several_inputs_is_read_from_its_file(digits, tmp_path, sent, no_leftover_workers):
    """A dict of inputs with one memory-mapped .npy: local workers read their rows of it from the file (none
    cross the wire or pass through the notebook), the other input travels; training and evaluation are those
    of the arrays in memory."""
    from nbdist.driver.inference import EvaluationJob
    from nbdist.inference_api import inference_request

    X, y = digits
    X, y = X[:600], y[:600]
    np.save(tmp_path / "pixels.npy", X)
    inputs = {"pixels": np.load(tmp_path / "pixels.npy", mmap_mode="r"), "half": X[:, :32].copy()}
    options = dict(epochs=2, batch_size=32, workers=2, strategy="allreduce", shuffle=False, ui="none")
    from_file, in_memory = two_input_model(), two_input_model()
    nbdist.train(from_file, inputs, y, **options)
    first = sent[1]
    nbdist.train(in_memory, {"pixels": X, "half": X[:, :32].copy()}, y, **options)
    assert first.data_source == "wire" and first.x["pixels"] is None and len(first.x["half"]) == 300
    assert first.data_file["leaves"]["0"]["deal"] == [600, 64, 2, 1]
    for a, b in zip(from_file.get_weights(), in_memory.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
    config, data = inference_request(from_file, inputs, y, None, True, {"workers": 2, "batch_size": 64}, "the model")
    evaluation = EvaluationJob(from_file, config, data)
    got = evaluation.run()
    assert evaluation._job_message(0).x["pixels"] is None
    want = from_file.evaluate({"pixels": X, "half": X[:, :32]}, y, batch_size=64, verbose=0, return_dict=True)
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-5), name


def test_sample_weights_with_a_memory_map_weigh_as_in_memory(digits, tmp_path, no_leftover_workers):
    """The file path streams features and labels; sample weights must still weigh every row (training
    and evaluation), as they do for the same array in memory."""
    from nbdist.driver.inference import EvaluationJob
    from nbdist.inference_api import inference_request

    X, y = digits
    X, y = X[:512], y[:512]
    w = np.where(y < 5, 3.0, 0.1).astype("float32")
    np.save(tmp_path / "x.npy", X)
    mapped = np.load(tmp_path / "x.npy", mmap_mode="r")
    options = dict(epochs=1, batch_size=32, workers=2, strategy="allreduce", shuffle=False, ui="none")
    from_file, in_memory = mlp(), mlp()
    nbdist.train(from_file, mapped, y, sample_weight=w, **options)
    nbdist.train(in_memory, X, y, sample_weight=w, **options)
    for a, b in zip(from_file.get_weights(), in_memory.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
    config, data = inference_request(in_memory, mapped, y, w, True, {"workers": 2, "batch_size": 64}, "the model")
    got = EvaluationJob(in_memory, config, data).run()
    want = in_memory.evaluate(X, y, sample_weight=w, batch_size=64, verbose=0, return_dict=True)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
