"""A notebook on Keras' JAX or torch backend, as a separate process (issue 25):
``python backend_driver.py BACKEND PHASE[,PHASE...]``.

Keras reads ``KERAS_BACKEND`` once, when it is first imported, so each backend needs a process of its
own; ``test_backends.py`` runs this script and reads the JSON line it prints last. Several phases in one
process share its imports and fork server (a notebook's session does too): their result is one dict by
phase, and a phase that raised holds its traceback under "error" while the next still runs. Everything a user
would do: the cell's own ``model.fit`` under ``%%dist_train`` (allreduce, Adam), ``nbdist.train`` with
averaging every step (plain SGD), ``nbdist.evaluate`` and ``nbdist.predict``, each beside the local Keras
call it must equal. Digits, 2 workers, 2 epochs.
"""
from __future__ import annotations

import json
import os
import sys

BACKEND = sys.argv[1]
PHASES = (sys.argv[2] if len(sys.argv) > 2 else "core").split(",")
os.environ["KERAS_BACKEND"] = BACKEND

import signal  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import nbdist  # noqa: E402
from nbdist.worker.runtime import jax_cache_dir  # noqa: E402

ROWS, GLOBAL_BATCH, EPOCHS = 512, 64, 2


def seeded(seed: int) -> dict[str, object]:
    """The same initial weights in every model built with it. Not keras.utils.set_random_seed: that imports
    TensorFlow whenever it is installed (to seed it too), which would hide whether nbdist does."""
    return {"kernel_initializer": keras.initializers.GlorotUniform(seed)}


def mlp(optimizer: object) -> keras.Model:
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu", **seeded(0)),
                              keras.layers.Dense(10, activation="softmax", **seeded(1))])
    model.compile(optimizer, "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def weight_gap(a: keras.Model, b: keras.Model) -> float:
    return max(float(np.abs(u - v).max()) for u, v in zip(a.get_weights(), b.get_weights()))


def main() -> dict[str, object]:
    features, labels = load_digits(return_X_y=True)
    features = (features / 16).astype("float32")
    x, y = features[:ROWS], labels[:ROWS].astype("int64")
    x_test, y_test = features[ROWS:ROWS + 300], labels[ROWS:ROWS + 300].astype("int64")
    fit_args = {"batch_size": GLOBAL_BATCH, "epochs": EPOCHS, "shuffle": False, "validation_split": 0.25}
    out: dict[str, object] = {"backend": keras.backend.backend(), "driver_tensorflow": "tensorflow" in sys.modules}

    # The cell's own model.fit under %%dist_train: allreduce equals the local step on the global batch.
    local = mlp(keras.optimizers.Adam(0.01))
    expected = local.fit(x, y, verbose=0, **fit_args).history
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbdist")
    shell.user_ns.update(X=x, y=y, mlp=mlp, keras=keras)
    shell.run_cell_magic("dist_train", "--workers 2 --strategy allreduce --lr-scaling none --ui none",
                         "model = mlp(keras.optimizers.Adam(0.01))\n"
                         "history = model.fit(X, y, batch_size=64, epochs=2, shuffle=False, validation_split=0.25)\n")
    model = shell.user_ns["model"]
    out["allreduce"] = {"history": shell.user_ns["history"].history, "expected": expected,
                        "weight_gap": weight_gap(model, local)}

    # nbdist.train, averaging after every step with plain SGD: the local step too.
    local_sgd = mlp(keras.optimizers.SGD(0.1))
    expected_sgd = local_sgd.fit(x, y, verbose=0, **fit_args).history
    remote_sgd = mlp(keras.optimizers.SGD(0.1))
    job = nbdist.train(remote_sgd, x, y, sample_weight=np.ones(len(y), "float32"), workers=2,
                       strategy="averaging", averaging_frequency=1, lr_scaling="none", ui="none",
                       **{k: v for k, v in fit_args.items() if k != "batch_size"}, batch_size=GLOBAL_BATCH // 2)
    out["averaging"] = {"history": job.fit_history.history, "expected": expected_sgd,
                        "weight_gap": weight_gap(remote_sgd, local_sgd),
                        "reports": {str(r): {k: job.reports[r].get(k) for k in ("keras_backend", "tensorflow_loaded")}
                                    for r in job.reports}}

    # Evaluation (merged metric state) and prediction (rows in order) of the model %%dist_train trained.
    out["evaluate"] = {"got": {k: float(v) for k, v in nbdist.evaluate(model, x_test, y_test, workers=2).items()
                               if k in ("loss", "accuracy")},
                       "expected": model.evaluate(x_test, y_test, verbose=0, return_dict=True)}
    predicted = nbdist.predict(model, x_test, workers=2)
    out["predict_gap"] = float(np.abs(np.asarray(predicted) - model.predict(x_test, verbose=0)).max())
    out["async"] = async_run(x, y, x_test, y_test)
    out["driver_tensorflow_end"] = "tensorflow" in sys.modules  # train, evaluate, predict never imported it
    return out


def async_run(x: np.ndarray, y: np.ndarray, x_test: np.ndarray, y_test: np.ndarray) -> dict[str, object]:
    """--strategy async on this backend (issue 38): arrays, 2 workers, 3 epochs; the model ends on the shared
    weights the workers last validated (its accuracy is the last merged val_accuracy)."""
    model = mlp(keras.optimizers.Adam(0.01))
    job = nbdist.train(model, x, y, workers=2, strategy="async", epochs=3, batch_size=16, ui="none",
                       validation_data=(x_test, y_test))
    return {"status": job.status, "val_accuracy": job.history["val_accuracy"],
            "accuracy": float(model.evaluate(x_test, y_test, verbose=0, return_dict=True)["accuracy"]),
            "pushed": [job.reports[r]["async_pushed"] for r in sorted(job.reports)],
            "reports": [[job.reports[r].get(k) for k in ("keras_backend", "tensorflow_loaded")]
                        for r in sorted(job.reports)]}


# -- the second run per backend: the code paths that differ per backend, beyond the plain fit --------------
BATCHES_CELL = """
class Batches(keras.utils.PyDataset):
    def __init__(self, x, y, batch, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.batch = x, y, batch
    def __len__(self):
        return len(self.x) // self.batch
    def __getitem__(self, i):
        s = slice(i * self.batch, (i + 1) * self.batch)
        return self.x[s], self.y[s]
"""


def cnn() -> keras.Model:
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(8, 3, activation="relu", **seeded(2)),
                              keras.layers.Flatten(), keras.layers.Dense(10, activation="softmax", **seeded(3))])
    model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def binary() -> keras.Model:
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu", **seeded(4)),
                              keras.layers.Dense(1, activation="sigmoid", **seeded(5))])
    model.compile(keras.optimizers.Adam(0.01), "binary_crossentropy",
                  metrics=["accuracy", keras.metrics.AUC(name="auc")])
    return model


class OwnStep(keras.Model):
    """A subclassed model whose train_step is written for the notebook's backend, as Keras' guides write it:
    torch: backward, then optimizer.apply; JAX: stateless, jax.value_and_grad then optimizer.stateless_apply."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(32, activation="relu", **seeded(6))
        self.out = keras.layers.Dense(10, activation="softmax", **seeded(7))
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy()
        self.loss_tracker = keras.metrics.Mean(name="loss")

    def call(self, x: object, training: object = None) -> object:
        return self.out(self.hidden(x))

    @property
    def metrics(self) -> list:
        return [self.loss_tracker]

    if BACKEND == "torch":
        def train_step(self, data: object) -> dict:
            import torch

            x, y = data
            self.zero_grad()
            loss = self.loss_fn(y, self(x, training=True))
            loss.backward()
            variables = list(self.trainable_weights)
            with torch.no_grad():
                self.optimizer.apply([v.value.grad for v in variables], variables)
            self.loss_tracker.update_state(loss)
            return {"loss": self.loss_tracker.result()}

    elif BACKEND == "jax":
        def loss_and_updates(self, trainable, non_trainable, x, y):
            y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x, training=True)
            return self.loss_fn(y, y_pred), non_trainable

        def train_step(self, state, data):
            import jax

            trainable, non_trainable, optimizer_vars, metric_vars = state
            x, y = data
            (loss, non_trainable), grads = jax.value_and_grad(self.loss_and_updates, has_aux=True)(
                trainable, non_trainable, x, y)
            trainable, optimizer_vars = self.optimizer.stateless_apply(optimizer_vars, grads, trainable)
            metric_vars = self.loss_tracker.stateless_update_state(metric_vars, loss)
            logs = {"loss": self.loss_tracker.stateless_result(metric_vars)}
            return logs, (trainable, non_trainable, optimizer_vars, metric_vars)


def own_step() -> keras.Model:
    model = OwnStep()
    model(np.zeros((2, 64), "float32"))  # two rows: BatchNorm1d refuses one in training mode
    model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
    return model


SEQ, VOCAB = 10, 40


def masked_sequences() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Padded sequences of random lengths: each worker's half of a global batch holds its own number of
    valid timesteps, so normalising by a half's valid entries differs from the global batch's."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, VOCAB, (ROWS // 2, SEQ))
    ids[np.arange(SEQ)[None, :] >= rng.integers(1, SEQ + 1, ROWS // 2)[:, None]] = 0  # mask_zero's padding
    floats = rng.normal(size=(ROWS // 2, SEQ, 3)).astype("float32")
    floats[np.arange(SEQ)[None, :] >= rng.integers(1, SEQ + 1, ROWS // 2)[:, None]] = 0.0  # Masking's padding
    x = {"ids": ids.astype("int32"), "fl": floats}
    y = {"seq": (ids % 3).astype("int32"), "mk": rng.normal(size=(ROWS // 2, SEQ, 1)).astype("float32")}
    return x, y


def masked_model() -> keras.Model:
    """Two masked losses per step (Embedding(mask_zero=True), then Masking): two sums per step, in order. On
    torch under ``jit_compile=True``: ``torch.compile`` traces the step, and nbdist's sums must run eagerly."""
    ids, fl = keras.Input((SEQ,), dtype="int32", name="ids"), keras.Input((SEQ, 3), name="fl")
    embedded = keras.layers.Embedding(VOCAB, 6, mask_zero=True,
                                      embeddings_initializer=keras.initializers.RandomUniform(seed=8))(ids)
    seq = keras.layers.Dense(3, activation="softmax", name="seq", **seeded(9))(embedded)
    mk = keras.layers.Dense(1, name="mk", **seeded(10))(keras.layers.Masking(0.0)(fl))
    model = keras.Model({"ids": ids, "fl": fl}, {"seq": seq, "mk": mk})
    model.compile(keras.optimizers.Adam(0.01), loss={"seq": "sparse_categorical_crossentropy", "mk": "mse"},
                  jit_compile=BACKEND == "torch")
    return model


def masked() -> dict[str, object]:
    """A masked loss under allreduce is normalised by the valid entries of the global batch, as the local step's."""
    x, y = masked_sequences()
    local, remote = masked_model(), masked_model()
    expected = local.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0).history
    job = nbdist.train(remote, x, y, workers=2, strategy="allreduce", batch_size=GLOBAL_BATCH // 2, epochs=EPOCHS,
                       shuffle=False, lr_scaling="none", ui="none")
    return {"history": job.fit_history.history, "expected": expected, "weight_gap": weight_gap(remote, local)}


def device_paths(x: np.ndarray, y: np.ndarray, plain: dict) -> dict[str, object]:
    """Issue 36 on this backend: one allreduce worker trains with Keras' own step (0 rounds, engine "none")
    and says where (CPU here); the model travels with no torch tensor in its pickle (Keras' torch layers hold
    their variables' tensors in ``_torch_params``). torch's device sum: ``torch_device_sums``."""
    import pickletools

    from nbdist.model.spec import travelling_model

    out: dict[str, object] = {}
    local, remote = mlp(keras.optimizers.Adam(0.01)), mlp(keras.optimizers.Adam(0.01))
    expected = local.fit(x, y, epochs=2, verbose=0, **plain).history
    job = nbdist.train(remote, x, y, workers=1, epochs=2, strategy="allreduce", lr_scaling="none", ui="none", **plain)
    report = job.reports[0]
    out["one_allreduce_worker"] = {"history": job.fit_history.history, "expected": expected,
                                   "weight_gap": weight_gap(remote, local),
                                   "report": [report["engine"], report["rounds"], report["device"]],
                                   "state_device": job.state.workers[0].device}
    graph = travelling_model(remote).graph
    out["graph_torch_names"] = [arg for op, arg, _ in pickletools.genops(graph)
                                if isinstance(arg, str) and (arg.startswith("torch") or "rebuild_" in arg)]
    return out


def torch_device_sums() -> dict[str, object]:
    """Issue 36 on torch: 2 workers summing their gradients as torch tensors (the GPU's code, over Gloo here:
    device_sum="always") in buckets of 1 KiB (4 for this MLP), started during the backward pass (the
    default) and at apply (overlap=False), against the numpy exchange and the local fit; the
    averaging strategy's rounds on the device too."""
    features, labels = load_digits(return_X_y=True)
    rows = ROWS + 1  # shares of 257 and 256 rows: worker 1 joins the last step of each epoch with zeros (a pad step)
    x, y = (features[:rows] / 16).astype("float32"), labels[:rows].astype("int64")
    plain = {"batch_size": GLOBAL_BATCH, "shuffle": False, "epochs": 2}
    per_worker = {**plain, "batch_size": GLOBAL_BATCH // 2, "workers": 2, "lr_scaling": "none", "ui": "none"}
    out: dict[str, object] = {}
    local = mlp(keras.optimizers.Adam(0.01))
    expected = local.fit(x, y, verbose=0, **plain).history
    settings = {"overlapped": {"device_sum": "always", "bucket_bytes": 1024},
                "at_apply": {"device_sum": "always", "bucket_bytes": 1024, "overlap": False},
                "numpy": {}}
    models = {}
    for name, options in settings.items():
        models[name] = mlp(keras.optimizers.Adam(0.01))
        job = nbdist.train(models[name], x, y, strategy="allreduce", **per_worker, **options)
        out[name] = {"history": job.fit_history.history, "expected": expected,
                     "weight_gap": weight_gap(models[name], local),
                     "summed_by": [job.reports[r]["summed_by"] for r in range(2)],
                     "padded": [job.reports[r]["padded_steps"] for r in range(2)]}
    out["overlapped_vs_at_apply"] = weight_gap(models["overlapped"], models["at_apply"])
    out["overlapped_vs_numpy"] = weight_gap(models["overlapped"], models["numpy"])
    out["notebook_hooks"] = sum(len(getattr(v.value, "_post_accumulate_grad_hooks", None) or {})
                                for v in models["overlapped"].trainable_variables)
    # The averaging strategy's rounds on the device too (every step with SGD: the local step).
    local_sgd, remote_sgd = mlp(keras.optimizers.SGD(0.1)), mlp(keras.optimizers.SGD(0.1))
    expected_sgd = local_sgd.fit(x, y, verbose=0, **plain).history
    averaged = nbdist.train(remote_sgd, x, y, strategy="averaging", averaging_frequency=1, device_sum="always",
                            **per_worker)
    out["device_average"] = {"history": averaged.fit_history.history, "expected": expected_sgd,
                             "weight_gap": weight_gap(remote_sgd, local_sgd),
                             "summed_by": [averaged.reports[r]["summed_by"] for r in range(2)]}
    out["in_process"] = overlapped_keras_steps(x[:ROWS], y[:ROWS])
    return out


def overlapped_keras_steps(x: np.ndarray, y: np.ndarray) -> dict[str, object]:
    """Keras' own torch train_step with the overlap, in this process on a one-rank Gloo group (the sum is the
    identity): plain, under a LossScaleOptimizer and with gradient_accumulation_steps=2, every step's early
    buckets held what ``apply`` got (none summed again), the weights equal the plain fit's, and ``close``
    leaves no hook on the model's tensors."""
    import torch.distributed as dist

    from nbdist.machine.engines import Plan
    from nbdist.strategies.backend_grads import HostGradientAllreduce, wrap_torch_optimizer
    from nbdist.strategies.collective import SoloCollective

    class Rows(keras.callbacks.Callback):
        def __init__(self, owner: HostGradientAllreduce) -> None:
            super().__init__()
            self.owner = owner

        def on_train_batch_begin(self, batch: int, logs: object = None) -> None:
            self.owner.set_weight(GLOBAL_BATCH, GLOBAL_BATCH)

    optimizers = {"adam": lambda: keras.optimizers.Adam(0.01),
                  "loss_scale": lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01)),
                  "accumulate": lambda: keras.optimizers.Adam(0.01, gradient_accumulation_steps=2)}
    plan = Plan("torch", "gloo", "device", overlap=True, bucket_bytes=1024)  # device_sum="always" on a CPU
    out: dict[str, object] = {}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for name, make in optimizers.items():
            local, model = mlp(make()), mlp(make())
            local.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
            owner = HostGradientAllreduce(SoloCollective(), model.trainable_variables, plan)
            wrap_torch_optimizer(model.optimizer, owner)
            refused = owner.overlap_backward(model)
            overlap = owner._overlap
            hooks = sum(len(v.value._post_accumulate_grad_hooks or {}) for v in model.trainable_variables)
            model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[Rows(owner)])
            owner.close()
            out[name] = {"refused": refused, "hooks": hooks, "steps": owner.steps, "buckets": len(overlap.plan),
                         "early": overlap.early_launches, "resummed": overlap.resummed,
                         "weight_gap": weight_gap(model, local),
                         "hooks_left": sum(len(v.value._post_accumulate_grad_hooks or {})
                                           for v in model.trainable_variables)}
    finally:
        dist.destroy_process_group()
    return out


def mixed_precision(x: np.ndarray, y: np.ndarray, plain: dict, per_worker: dict) -> dict[str, object]:
    """Issue 36: a model made under ``mixed_float16`` (a LossScaleOptimizer wraps SGD; float16 compute,
    float32 variables) and under ``mixed_bfloat16``: 2 allreduce workers beside the local fit on the global
    batch, one epoch; the loss scale's state comes back too."""
    out: dict[str, object] = {}
    for policy in ("mixed_float16", "mixed_bfloat16"):
        keras.mixed_precision.set_global_policy(policy)
        try:  # SGD: an update proportional to its gradient (Adam's ~lr*sign(g) magnifies rounding near 0)
            local, remote = mlp(keras.optimizers.SGD(0.1)), mlp(keras.optimizers.SGD(0.1))
        finally:
            keras.mixed_precision.set_global_policy("float32")
        expected = local.fit(x, y, epochs=1, verbose=0, **plain).history
        job = nbdist.train(remote, x, y, workers=2, epochs=1, strategy="allreduce", lr_scaling="none", ui="none",
                           shuffle=False, **per_worker)
        scale = [float(np.asarray(v)) for m in (local, remote) for v in m.optimizer.variables
                 if v.path.endswith("dynamic_scale")]
        out[policy] = {"history": job.fit_history.history, "expected": expected,
                       "weight_gap": weight_gap(remote, local), "optimizer": type(remote.optimizer).__name__,
                       "compute_dtype": remote.layers[0].compute_dtype, "loss_scale": scale}
    return out


def more() -> dict[str, object]:
    from nbdist.api import prepare
    from nbdist.config import TrainConfig

    features, labels = load_digits(return_X_y=True)
    features = (features / 16).astype("float32")
    x, y = features[:ROWS], labels[:ROWS].astype("int64")
    x_test, y_test = features[ROWS:ROWS + 300], labels[ROWS:ROWS + 300].astype("int64")
    out: dict[str, object] = {"backend": keras.backend.backend()}
    plain = {"batch_size": GLOBAL_BATCH, "shuffle": False}
    per_worker = {"batch_size": GLOBAL_BATCH // 2}  # nbdist.train's batch_size is each worker's
    tensorflow = out.setdefault("tensorflow_after", {})

    # One worker is the local fit.
    local, remote = mlp(keras.optimizers.Adam(0.01)), mlp(keras.optimizers.Adam(0.01))
    expected = local.fit(x, y, epochs=2, verbose=0, **plain).history
    job = nbdist.train(remote, x, y, workers=1, epochs=2, lr_scaling="none", ui="none", **plain)
    tensorflow["one_worker"] = "tensorflow" in sys.modules
    out["one_worker"] = {"history": job.fit_history.history, "expected": expected,
                         "weight_gap": weight_gap(remote, local)}
    out.update(device_paths(x, y, plain))
    out["mixed"] = mixed_precision(x, y, plain, per_worker)

    # A small CNN under allreduce, and EarlyStopping(restore_best_weights=True) in the notebook.
    def stopper() -> keras.callbacks.EarlyStopping:
        return keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=0.05, patience=1,
                                             restore_best_weights=True)

    images, images_test = x.reshape(-1, 8, 8, 1), x_test.reshape(-1, 8, 8, 1)
    fit_cnn = {**plain, "epochs": 8, "validation_data": (images_test, y_test)}
    local, remote = cnn(), cnn()
    expected = local.fit(images, y, verbose=0, callbacks=[stopper()], **fit_cnn).history
    job = nbdist.train(remote, images, y, workers=2, strategy="allreduce", lr_scaling="none", ui="none",
                       callbacks=[stopper()], **{**fit_cnn, **per_worker})
    tensorflow["cnn"] = "tensorflow" in sys.modules
    out["cnn"] = {"history": job.fit_history.history, "expected": expected, "weight_gap": weight_gap(remote, local),
                  "accuracy": float(remote.evaluate(images_test, y_test, verbose=0)[1]),
                  "local_accuracy": float(local.evaluate(images_test, y_test, verbose=0)[1])}

    # A subclassed model with its own train_step for this backend, under allreduce.
    local, remote = own_step(), own_step()
    expected = local.fit(x, y, epochs=2, verbose=0, **plain).history
    job = nbdist.train(remote, x, y, workers=2, strategy="allreduce", epochs=2, lr_scaling="none", ui="none",
                       **{**plain, **per_worker})
    tensorflow["own_step"] = "tensorflow" in sys.modules
    out["own_step"] = {"history": job.fit_history.history, "expected": expected,
                       "weight_gap": weight_gap(remote, local)}

    # Evaluation with AUC (merged thresholds' counts), loss and accuracy.
    model = binary()
    binary_y, binary_y_test = (y == 0).astype("float32"), (y_test == 0).astype("float32")
    model.fit(x, binary_y, epochs=1, verbose=0, batch_size=64)
    got = nbdist.evaluate(model, x_test, binary_y_test, workers=2)
    tensorflow["evaluate_auc"] = "tensorflow" in sys.modules
    out["evaluate_auc"] = {"got": {k: float(got[k]) for k in ("loss", "accuracy", "auc")},
                           "expected": model.evaluate(x_test, binary_y_test, verbose=0, return_dict=True)}

    # Checkpoints: worker 1 killed after epoch 2 of 4, --max-restarts 1 resumes from the checkpoint; then
    # --resume continues the saved run to epoch 5. Allreduce with Adam: both end at the local fit's weights.
    local = mlp(keras.optimizers.Adam(0.01))
    local.fit(x, y, epochs=4, verbose=0, **plain)
    after_four = local.get_weights()
    local.fit(x, y, epochs=5, initial_epoch=4, verbose=0, **plain)
    killed: list[int] = []

    def kill_after_two(kind: str, state: object, payload: object) -> None:
        if kind == "epoch" and not killed and state.initial_epoch + state.epochs_done >= 2:
            killed.append(state.workers[1].pid)
            os.kill(killed[0], signal.SIGKILL)

    with tempfile.TemporaryDirectory() as ckpt:
        remote = mlp(keras.optimizers.Adam(0.01))
        options = {"workers": 2, "strategy": "allreduce", "lr_scaling": "none", "ui": "none", "checkpoint_dir": ckpt,
                   **plain, **per_worker}
        job = prepare(remote, TrainConfig(epochs=4, max_restarts=1, **options), x, y, None, listeners=[kill_after_two])
        job.start()
        job.run_in_background()
        job.wait(timeout=300)
        restarted = {"status": job.status, "restarts": job.state.restarts, "killed": len(killed),
                     "weight_gap": max(float(np.abs(a - b).max()) for a, b in zip(remote.get_weights(), after_four))}
        resumed_model = mlp(keras.optimizers.Adam(0.01))  # a fresh cell: its weights and slots are replaced
        resumed_model.set_weights([w + 1 for w in resumed_model.get_weights()])
        resumed = nbdist.train(resumed_model, x, y, epochs=5, resume=True, **options)
        tensorflow["restart"] = "tensorflow" in sys.modules
    out["restart"] = {**restarted, "resumed_initial_epoch": resumed.state.initial_epoch,
                          "resumed_epochs": resumed.state.epochs_done,
                          "resumed_gap": weight_gap(resumed_model, local)}

    # A PyDataset in the cell's own fit: each worker reads every other batch of 32, one step joins two; of 15
    # batches, so worker 1 takes part in the last step of each epoch without rows (a pad step). Validation on a
    # PyDataset of 9 batches: a share of 5 and of 4, each validation all of it (Keras' generator adapter, which
    # JAX and torch read it through, replays 2 peeked batches at every pass: one kept iterator reads each pass).
    local = mlp(keras.optimizers.SGD(0.1))
    expected = local.fit(x[:480], y[:480], epochs=2, verbose=0, validation_data=(x_test[:288], y_test[:288]),
                         **plain).history
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbdist")
    shell.user_ns.update(X=x, y=y, Xt=x_test, yt=y_test, mlp=mlp, keras=keras)
    shell.run_cell(BATCHES_CELL)
    shell.run_cell_magic("dist_train", "--workers 2 --strategy allreduce --lr-scaling none --ui none",
                         "model = mlp(keras.optimizers.SGD(0.1))\n"
                         "history = model.fit(Batches(X[:480], y[:480], 32), epochs=2, shuffle=False,\n"
                         "                    validation_data=Batches(Xt, yt, 32))\n")
    tensorflow["py_dataset"] = "tensorflow" in sys.modules
    out["py_dataset"] = {"history": shell.user_ns["history"].history, "expected": expected,
                         "weight_gap": weight_gap(shell.user_ns["model"], local)}

    out["masked"] = masked()
    tensorflow["masked"] = "tensorflow" in sys.modules
    out["driver_tensorflow_end"] = "tensorflow" in sys.modules
    return out


def same_as_local(where: str) -> dict[str, object]:
    """On ``--backend where``: allreduce with Adam equals the local fit, evaluate equals model.evaluate,
    and every worker ran the notebook's backend."""
    features, labels = load_digits(return_X_y=True)
    features = (features / 16).astype("float32")
    x, y = features[:ROWS], labels[:ROWS].astype("int64")
    x_test, y_test = features[ROWS:ROWS + 300], labels[ROWS:ROWS + 300].astype("int64")
    plain = {"shuffle": False, "epochs": 2}
    local, remote = mlp(keras.optimizers.Adam(0.01)), mlp(keras.optimizers.Adam(0.01))
    expected = local.fit(x, y, verbose=0, batch_size=GLOBAL_BATCH, **plain).history
    job = nbdist.train(remote, x, y, backend=where, workers=2, strategy="allreduce", lr_scaling="none",
                       ui="none", batch_size=GLOBAL_BATCH // 2, **plain)
    got = nbdist.evaluate(remote, x_test, y_test, backend=where, workers=2)
    return {"backend": keras.backend.backend(), "history": job.fit_history.history, "expected": expected,
            "weight_gap": weight_gap(remote, local),
            "reports": [job.reports[r].get("keras_backend") for r in sorted(job.reports)],
            "evaluate": {"got": {k: float(got[k]) for k in ("loss", "accuracy")},
                         "expected": remote.evaluate(x_test, y_test, verbose=0, return_dict=True)},
            "driver_tensorflow_end": "tensorflow" in sys.modules}


def on_spark() -> dict[str, object]:
    """A local[2] Spark session of this process, or (argument 3) a Connect server's URL."""
    from tests.spark_helpers import spark_session

    if len(sys.argv) > 3:
        from pyspark.sql import SparkSession

        session = SparkSession.builder.remote(sys.argv[3]).getOrCreate()
    else:
        session = spark_session("local[2]")
    try:
        return same_as_local("spark")
    finally:
        session.stop()


def seeded_cells() -> dict[str, object]:
    """Issue 39 on this backend: a cell seeded with keras.utils.set_random_seed (which imports TensorFlow here,
    in the notebook, as it does locally) run twice under %%dist_train gives identical weights and History; an
    unseeded one, whose own draws are fixed, twice gives different ones; the workers never import TensorFlow."""
    features, labels = load_digits(return_X_y=True)
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbdist")
    shell.user_ns.update(X=(features[:ROWS] / 16).astype("float32"), y=labels[:ROWS].astype("int64"), keras=keras,
                         fixed_top=[np.full((32, 10), 0.05, "float32"), np.zeros(10, "float32")])
    fit = "history = model.fit(X, y, batch_size=64, epochs=2, validation_split=0.25)\n"
    cells = {"seeded": "keras.utils.set_random_seed(42)\n"
                       "model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation='relu'),\n"
                       "    keras.layers.Dropout(0.3), keras.layers.Dense(10, activation='softmax')])\n",
             "unseeded": "init = keras.initializers.GlorotUniform(7)\n"
                         "model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, 'relu', "
                         "kernel_initializer=init),\n"
                         "    keras.layers.Dropout(0.3, seed=5), keras.layers.Dense(10, 'softmax')])\n"
                         "model.layers[-1].set_weights(fixed_top)\n"}
    out: dict[str, object] = {"backend": keras.backend.backend()}

    def listed() -> list[str]:
        return sorted(p.name for p in jax_cache_dir().glob("*")) if jax_cache_dir().is_dir() else []

    for name, cell in cells.items():
        runs, cached = [], [listed()]  # what earlier phases of this process stored
        for _ in range(2):
            shell.run_cell_magic("dist_train", "--workers 2 --ui none",
                                 cell + "model.compile('adam', 'sparse_categorical_crossentropy', "
                                        "metrics=['accuracy'])\n" + fit)
            job = shell.user_ns["history_job"]
            runs.append((shell.user_ns["model"], shell.user_ns["history"].history,
                         [job.reports[r].get("tensorflow_loaded") for r in sorted(job.reports)]))
            cached.append(listed())
        (a, history_a, tf_a), (b, history_b, tf_b) = runs
        out[name] = {"weight_gap": weight_gap(a, b), "same_history": history_a == history_b,
                     "workers_tensorflow": tf_a + tf_b, "cached": cached}
    out["tensorboard"] = batch_summaries(shell)
    return out


def batch_summaries(shell: InteractiveShell) -> dict[str, list[str]]:
    """The notebook's TensorBoard(update_freq=1) on this backend (Keras' TensorBoard imports TensorFlow, here as
    locally): the tags of its train and validation runs, written by worker 0 (batches) and the notebook (epochs)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with tempfile.TemporaryDirectory() as tb:
        shell.user_ns["TB"] = tb
        shell.run_cell_magic("dist_train", "--workers 2 --ui none",
                             "model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, 'softmax')])\n"
                             "model.compile('adam', 'sparse_categorical_crossentropy')\n"
                             "model.fit(X, y, batch_size=64, epochs=2, validation_split=0.25, verbose=0,\n"
                             "          callbacks=[keras.callbacks.TensorBoard(TB, update_freq=1)])\n")
        tags = {}
        for run in ("train", "validation"):
            acc = EventAccumulator(os.path.join(tb, run), size_guidance={"tensors": 0, "scalars": 0})
            acc.Reload()
            tags[run] = sorted(set(acc.Tags().get("tensors", [])) | set(acc.Tags().get("scalars", [])))
    return tags


def async_only() -> dict[str, object]:
    features, labels = load_digits(return_X_y=True)
    features = (features / 16).astype("float32")
    return async_run(features[:ROWS], labels[:ROWS].astype("int64"), features[ROWS:ROWS + 300],
                     labels[ROWS:ROWS + 300].astype("int64"))


def other_apis() -> dict[str, object]:
    """Issue 46, what a user of this backend brings from elsewhere. torch: a Keras model around torch.nn modules
    (TorchModuleWrapper) under allreduce; keras.io's MNIST convnet shape on digits under averaging every step
    with validation_split=0.1 and a short last batch. JAX: the Keras distribution guide's cell
    (set_distribution(DataParallel(...))) under %%dist_train, beside the same cell's local fit."""
    import logging

    features, labels = load_digits(return_X_y=True)
    x, y = (features[:ROWS] / 16).astype("float32"), labels[:ROWS].astype("int64")
    plain = {"epochs": EPOCHS, "shuffle": False}
    out: dict[str, object] = {"backend": keras.backend.backend(), "own_methods": own_methods(features, labels)}
    if BACKEND == "torch":
        local, remote = torch_wrapped(), torch_wrapped()
        expected = local.fit(x, y, batch_size=GLOBAL_BATCH, verbose=0, **plain).history
        job = nbdist.train(remote, x, y, workers=2, batch_size=GLOBAL_BATCH // 2, strategy="allreduce",
                           lr_scaling="none", ui="none", **plain)
        out["torch_module"] = {"history": job.fit_history.history, "expected": expected,
                               "weight_gap": weight_gap(remote, local)}
        # A torch BatchNorm1d inside the wrapper: its running statistics are module buffers, no Keras variable.
        xv, yv = (features[ROWS:ROWS + 200] / 16).astype("float32"), labels[ROWS:ROWS + 200].astype("int64")
        local, remote = torch_wrapped(batchnorm=True), torch_wrapped(batchnorm=True)
        local.fit(x, y, batch_size=GLOBAL_BATCH, verbose=0, **plain)
        job = nbdist.train(remote, x, y, workers=2, batch_size=GLOBAL_BATCH // 2, strategy="allreduce",
                           lr_scaling="none", ui="none", validation_data=(xv, yv), **plain)
        stats = [(remote.hidden.module[1].running_mean, local.hidden.module[1].running_mean),
                 (remote.hidden.module[1].running_var, local.hidden.module[1].running_var)]
        out["torch_batchnorm"] = {
            "val_accuracy": job.fit_history.history["val_accuracy"][-1],
            "notebook_accuracy": remote.evaluate(xv, yv, verbose=0, return_dict=True)["accuracy"],
            "moved": min(float((r - 0.0 if i == 0 else r - 1.0).abs().max()) for i, (r, _) in enumerate(stats)),
            "gap_to_local": max(float((r - lo).abs().max() / lo.abs().max()) for r, lo in stats),
            "batches_tracked": int(remote.hidden.module[1].num_batches_tracked)}
        # The same run cut after its first epoch and resumed from the checkpoint in a fresh cell's model: the
        # statistics carry on from the checkpoint's (not the fresh module's 0 / 1), so both runs end alike.
        with tempfile.TemporaryDirectory() as ckpt:
            options = {"workers": 2, "batch_size": GLOBAL_BATCH // 2, "strategy": "allreduce", "lr_scaling": "none",
                       "ui": "none", "validation_data": (xv, yv), "checkpoint_dir": ckpt, "shuffle": False}
            nbdist.train(torch_wrapped(batchnorm=True), x, y, epochs=EPOCHS - 1, **options)
            resumed = torch_wrapped(batchnorm=True)
            nbdist.train(resumed, x, y, epochs=EPOCHS, resume=True, **options)
        pairs = [(resumed.hidden.module[1].running_mean, stats[0][0]), (resumed.hidden.module[1].running_var,
                                                                        stats[1][0])]
        out["torch_batchnorm"]["resumed_gap"] = max(float((r - u).abs().max()) for r, u in pairs)
        out["torch_batchnorm"]["resumed_batches_tracked"] = int(resumed.hidden.module[1].num_batches_tracked)
        local, remote = mnist_convnet(), mnist_convnet()
        expected = local.fit(x.reshape(-1, 8, 8, 1), y, batch_size=128, validation_split=0.1, verbose=0,
                             **plain).history
        job = nbdist.train(remote, x.reshape(-1, 8, 8, 1), y, workers=2, batch_size=64, validation_split=0.1,
                           strategy="averaging", averaging_frequency=1, lr_scaling="none", ui="none", **plain)
        out["convnet_averaging"] = {"history": job.fit_history.history, "expected": expected,
                                    "weight_gap": weight_gap(remote, local)}
        return out
    cell = ("keras.distribution.set_distribution(keras.distribution.DataParallel(devices=keras.distribution."
            "list_devices()))\nmodel = mlp(keras.optimizers.Adam(0.01))\n"
            "history = model.fit(X, y, batch_size=64, epochs=2, shuffle=False, verbose=0)\n")
    local: dict = {"keras": keras, "mlp": mlp, "X": x, "y": y}
    exec(cell, local)
    notices: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: notices.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("nbdist").addHandler(handler)
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbdist")
    shell.user_ns.update(X=x, y=y, mlp=mlp, keras=keras)
    try:
        shell.run_cell_magic("dist_train", "--workers 2 --strategy allreduce --lr-scaling none --ui none", cell)
    finally:
        logging.getLogger("nbdist").removeHandler(handler)
        keras.distribution.set_distribution(None)
    out["keras_distribution"] = {"history": shell.user_ns["history"].history, "expected": local["history"].history,
                                 "weight_gap": weight_gap(shell.user_ns["model"], local["model"]),
                                 "notices": [n for n in notices if "replaced" in n]}
    return out


def own_methods(features: np.ndarray, labels: np.ndarray) -> dict[str, object]:
    """A model whose class preprocesses in its own fit, evaluate and predict before calling Keras' (keras_hub's
    models do, into a tf.data pipeline; here numpy's scaling, which a batch generator cannot take): the cell's
    fit under %%dist_train, then nbdist.evaluate and nbdist.predict on raw rows, beside the local calls."""
    def scaled(data):
        return data if isinstance(data, tuple) and len(data) == 0 else (data[0] / 16.0, *data[1:])

    class Scaling(keras.Sequential):
        def fit(self, x=None, y=None, validation_data=None, **kwargs):
            return super().fit(x / 16.0, y, validation_data=validation_data and scaled(validation_data), **kwargs)

        def evaluate(self, x=None, y=None, **kwargs):
            if kwargs.get("_use_cached_eval_dataset"):  # fit's validation, made by fit
                return super().evaluate(x, y, **kwargs)
            return super().evaluate(x / 16.0, y, **kwargs)

        def predict(self, x=None, **kwargs):
            return super().predict(x / 16.0, **kwargs)

    def make() -> keras.Model:
        model = Scaling([keras.Input((64,)), keras.layers.Dense(32, activation="relu", **seeded(0)),
                         keras.layers.Dense(10, activation="softmax", **seeded(1))])
        model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    x, y = features[:ROWS].astype("float32"), labels[:ROWS].astype("int64")
    xv, yv = features[ROWS:ROWS + 200].astype("float32"), labels[ROWS:ROWS + 200].astype("int64")
    cell = "history = model.fit(X, y, batch_size=64, epochs=2, shuffle=False, verbose=0, validation_data=(Xv, yv))\n"
    local = make()
    expected = local.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0, validation_data=(xv, yv)).history
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbdist")
    shell.user_ns.update(X=x, y=y, Xv=xv, yv=yv, model=make())
    shell.run_cell_magic("dist_train", "--workers 2 --strategy allreduce --lr-scaling none --ui none", cell)
    model = shell.user_ns["model"]
    got = nbdist.evaluate(model, xv, yv, workers=2)
    predicted = np.asarray(nbdist.predict(model, xv, workers=2))
    return {"history": shell.user_ns["history"].history, "expected": expected, "weight_gap": weight_gap(model, local),
            "evaluate": {"got": [float(got["loss"]), float(got["accuracy"])],
                         "expected": local.evaluate(xv, yv, verbose=0)},
            "predict_gap": float(np.abs(predicted - local.predict(xv, verbose=0)).max())}


def lazy_loader() -> dict[str, object]:
    """Issue 46 on torch: a cell's model.fit(DataLoader) over a map-style Dataset whose __getitem__ reads one
    row at a time (a class of the notebook's, sent by value), 300 rows in batches of 64 (a short last batch),
    validated on a DataLoader of another 100, under %%dist_train with 2 workers and allreduce, beside the same
    cell's local fit."""
    import torch
    from torch.utils.data import DataLoader, Dataset

    features, labels = load_digits(return_X_y=True)

    class LazyDigits(Dataset):
        def __init__(self, start: int, stop: int) -> None:
            self.start, self.stop = start, stop

        def __len__(self) -> int:
            return self.stop - self.start

        def __getitem__(self, i: int) -> tuple[object, object]:
            row = self.start + i
            return (torch.tensor(features[row] / 16, dtype=torch.float32),
                    torch.tensor(labels[row], dtype=torch.int64))

    cell = ("model = mlp(keras.optimizers.Adam(0.01))\n"
            "history = model.fit(DataLoader(LazyDigits(0, 300), batch_size=64), epochs=2, verbose=0,\n"
            "                    validation_data=DataLoader(LazyDigits(300, 400), batch_size=64))\n")
    names = {"keras": keras, "mlp": mlp, "DataLoader": DataLoader, "LazyDigits": LazyDigits}
    local = dict(names)
    exec(cell, local)
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbdist")
    shell.user_ns.update(names)
    shell.run_cell_magic("dist_train", "--workers 2 --strategy allreduce --ui none", cell)
    # The trained model evaluated and predicted on a lazy loader of 100 rows in batches of 32 by 2 workers,
    # beside the same model's own evaluate and predict of that loader.
    model, held_out = shell.user_ns["model"], DataLoader(LazyDigits(300, 400), batch_size=32)
    merged = nbdist.evaluate(model, held_out, workers=2)
    expected = model.evaluate(held_out, verbose=0, return_dict=True)
    shuffled = ""
    try:
        nbdist.predict(model, DataLoader(LazyDigits(300, 400), batch_size=32, shuffle=True), workers=2)
    except nbdist.NbdistError as exc:
        shuffled = str(exc)
    return {"backend": keras.backend.backend(), "history": shell.user_ns["history"].history,
            "expected": local["history"].history, "weight_gap": weight_gap(shell.user_ns["model"], local["model"]),
            "evaluate_gap": max(abs(merged[k] - expected[k]) for k in expected),
            "samples": merged["samples"],
            "predict_gap": float(np.abs(nbdist.predict(model, held_out, workers=2)
                                        - model.predict(held_out, verbose=0)).max()),
            "shuffled_predict": shuffled}


def torch_wrapped(batchnorm: bool = False) -> keras.Model:
    """A Keras model whose layers are torch.nn modules, as keras.layers.TorchModuleWrapper's docs write it
    (``batchnorm``: the hidden module a Linear then a BatchNorm1d)."""
    import torch

    class Wrapped(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            hidden = torch.nn.Linear(64, 32)
            self.hidden = keras.layers.TorchModuleWrapper(
                torch.nn.Sequential(hidden, torch.nn.BatchNorm1d(32)) if batchnorm else hidden)
            self.out = keras.layers.TorchModuleWrapper(torch.nn.Linear(32, 10))

        def call(self, x: object, training: object = None) -> object:
            hidden = torch.relu(self.hidden(x, training=training))
            return torch.nn.functional.softmax(self.out(hidden, training=training), dim=1)

    model = Wrapped()
    model(np.zeros((2, 64), "float32"))  # two rows: BatchNorm1d refuses one in training mode
    model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def mnist_convnet() -> keras.Model:
    """keras.io's MNIST convnet, shrunk to digits' 8x8 images (Dropout at 0: the same step)."""
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(8, 3, activation="relu", **seeded(11)),
                              keras.layers.MaxPooling2D(2), keras.layers.Flatten(), keras.layers.Dropout(0.0),
                              keras.layers.Dense(10, activation="softmax", **seeded(12))])
    model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


if __name__ == "__main__":
    phases = {"core": main, "more": more, "spark": on_spark, "containers": lambda: same_as_local("containers"),
              "seeded": seeded_cells, "async": async_only, "device_sum": torch_device_sums,
              "other_apis": other_apis, "lazy_loader": lazy_loader,
              "jax_engine": lambda: __import__("jax_engine_driver").main()}
    if len(PHASES) == 1:
        result = phases[PHASES[0]]()
    else:
        result = {}
        for phase in PHASES:
            started = time.monotonic()
            try:
                result[phase] = phases[phase]()
            except Exception:  # the test names the phase and shows this traceback
                result[phase] = {"error": traceback.format_exc()}
            print(f"phase {phase}: {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    print("NBDIST-RESULT " + json.dumps(result, default=float), flush=True)
