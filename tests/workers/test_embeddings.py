"""Embeddings under allreduce take the local step on the global batch (issue 39): every way a model looks a
table up, with the optimizers whose update from a sparse gradient depends on how it is cut into slices.

One functional model holds every pattern, so each case is one launch of workers:
- ``text``: keras.io's ``TokenAndPositionEmbedding`` as written: per-row token ids, and a position table
  looked up on ``arange(maxlen)`` once per step (a broadcast lookup: its slices hold the batch's sum);
- ``a``/``b``: one table shared by two inputs, also looked up on a fixed index in the same step (its
  gradient concatenates per-row and broadcast segments);
- ``big``/``reg`` as a two-tower recommender: a user table of 150,000 rows (1.2M parameters: with it the
  model is "large" for the fused kernels) whose ids repeat within and across the workers' shares (most
  drawn from 40 popular rows), each tower a Dense layer and a unit norm, and their dot product;
- ``seq``: ``mask_zero`` over padded ids (a masked mean);
- ``reg``: an L2-regularised table (its gradient is dense: the penalty touches every row).
1025 rows and a global batch of 256: the last batch has one row, so on 2 workers the second takes a pad
step. On the old code (1ead9a4) the 2-worker Adam, AdamW, RMSprop and Adagrad cases failed (the position
table's and the anchor's slices were concatenated, not summed: Adam squared each worker's part), and so did
the 1-worker Adam case (the big table made the model "large", its Dense layers got the fused kernel, and
Adam on the table's rows, whose gradients are near its epsilon at this batch, grew the last-bit
differences to 3e-5 in 10 steps). SGD with momentum is linear in the slices: it passed before too.
"""
from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest

import nbdist

from .test_same_step import assert_same

pytestmark = pytest.mark.usefixtures("no_leftover_workers")

ROWS, MAXLEN, VOCAB, BIG, GLOBAL_BATCH, EPOCHS = 1025, 8, 60, 150_000, 256, 2


def data(rows: int, seed: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(seed)
    text = rng.integers(0, VOCAB, (rows, MAXLEN))
    lengths = rng.integers(1, MAXLEN + 1, rows)
    padded = np.where(np.arange(MAXLEN)[None, :] < lengths[:, None], rng.integers(1, VOCAB, (rows, MAXLEN)), 0)
    popular = rng.random(rows) < 0.8
    big = np.where(popular, rng.integers(0, 40, rows), rng.integers(0, BIG, rows))
    x = {"text": text, "a": rng.integers(0, VOCAB, (rows, 1)), "b": rng.integers(0, VOCAB, (rows, 1)),
         "big": big[:, None], "seq": padded, "reg": rng.integers(0, VOCAB, (rows, 1))}
    y = ((text[:, 0] + big) % 2).astype("int32")
    return {k: v.astype("int32") for k, v in x.items()}, y


def embedding_model(optimizer: Any) -> Any:
    """Classes defined here, as a notebook defines them: they travel by value."""
    class TokenAndPositionEmbedding(keras.layers.Layer):  # keras.io's text classification with Transformer
        def __init__(self, maxlen, vocab_size, embed_dim):
            super().__init__()
            self.token_emb = keras.layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
            self.pos_emb = keras.layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

        def call(self, x):
            maxlen = keras.ops.shape(x)[-1]
            positions = keras.ops.arange(start=0, stop=maxlen, step=1)
            positions = self.pos_emb(positions)
            x = self.token_emb(x)
            return x + positions

    class SharedTable(keras.layers.Layer):
        """One table for two inputs, plus a lookup on fixed rows (an anchor) in the same step."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.table = keras.layers.Embedding(VOCAB, 4)

        def call(self, a, b):
            anchor = keras.ops.mean(self.table(keras.ops.arange(3)), axis=0)
            return keras.ops.concatenate([self.table(a)[:, 0] * self.table(b)[:, 0], self.table(b)[:, 0] + anchor], -1)

    keras.utils.set_random_seed(11)
    inputs = {"text": keras.Input((MAXLEN,), dtype="int32", name="text"),
              "a": keras.Input((1,), dtype="int32", name="a"), "b": keras.Input((1,), dtype="int32", name="b"),
              "big": keras.Input((1,), dtype="int32", name="big"),
              "seq": keras.Input((MAXLEN,), dtype="int32", name="seq"),
              "reg": keras.Input((1,), dtype="int32", name="reg")}
    def two_tower(user, item):  # the large table: a recommender's user tower against an item tower
        towers = []
        for ids, rows in ((user, BIG), (item, VOCAB)):
            vectors = keras.layers.Flatten()(keras.layers.Embedding(rows, 8)(ids))
            towers.append(keras.layers.UnitNormalization()(keras.layers.Dense(8)(vectors)))
        return keras.layers.Dot(axes=1)(towers)

    pool = keras.layers.GlobalAveragePooling1D
    features = [
        pool()(TokenAndPositionEmbedding(MAXLEN, VOCAB, 6)(inputs["text"])),
        SharedTable()(inputs["a"], inputs["b"]),
        two_tower(inputs["big"], inputs["reg"]),
        pool()(keras.layers.Embedding(VOCAB, 4, mask_zero=True)(inputs["seq"])),
        keras.layers.Flatten()(keras.layers.Embedding(
            VOCAB, 3, embeddings_regularizer=keras.regularizers.L2(1e-3))(inputs["reg"])),
    ]
    hidden = keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()(features))
    model = keras.Model(inputs, keras.layers.Dense(2, activation="softmax")(hidden))
    model.compile(optimizer, "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def local_and_remote(optimizer: Any, workers: int, **options: Any) -> tuple[Any, Any, dict[str, list[float]], Any]:
    x, y = data(ROWS, 0)
    validation = data(40, 1)
    config = keras.optimizers.serialize(optimizer)
    local = embedding_model(keras.optimizers.deserialize(config))
    remote = embedding_model(keras.optimizers.deserialize(config))
    remote.set_weights(local.get_weights())
    expected = local.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                         validation_data=validation).history
    job = nbdist.train(remote, x, y, validation_data=validation, epochs=EPOCHS, batch_size=GLOBAL_BATCH // workers,
                       workers=workers, shuffle=False, lr_scaling="none", **options)
    return local, remote, expected, job


@pytest.mark.parametrize("optimizer, workers", [
    (keras.optimizers.Adam(0.01), 2),
    pytest.param(keras.optimizers.AdamW(0.01, weight_decay=0.05), 2, marks=pytest.mark.full),
    pytest.param(keras.optimizers.RMSprop(0.01), 2, marks=pytest.mark.full),
    (keras.optimizers.Adagrad(0.1), 2),
    pytest.param(keras.optimizers.SGD(0.05, momentum=0.9), 2, marks=pytest.mark.full(
        "a linear update of the same slices: the averaging SGD test below")),
    (keras.optimizers.Adam(0.01), 1),
], ids=["adam-2", "adamw-2", "rmsprop-2", "adagrad-2", "sgd-momentum-2", "adam-1"])
def test_allreduce_equals_the_local_step_for_every_lookup(optimizer, workers):
    """Weights and every History entry of the local fit on the global batch, to 1e-5."""
    assert_same(*local_and_remote(optimizer, workers, strategy="allreduce"))


def test_averaging_every_step_with_sgd_equals_the_local_step_for_every_lookup():
    """Averaging after every step with plain SGD (linear in the slices): the same, pad step included."""
    assert_same(*local_and_remote(keras.optimizers.SGD(0.1), 2, strategy="averaging", averaging_frequency=1))
