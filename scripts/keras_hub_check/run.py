"""keras_hub's models through nbdist, as a notebook trains them (not shipped, not in CI).

    .venv/bin/pip install --target /tmp/khlib --no-deps keras-hub regex kagglehub kagglesdk==0.1.28 tokenizers \
        sentencepiece   # beside the venv: nbdist does not depend on it
    KERAS_BACKEND=jax PYTHONPATH=$PWD:/tmp/khlib .venv/bin/python scripts/keras_hub_check/run.py

Each model is built from its config (nothing is downloaded), fit locally, then fit by the same cell under
``%%dist_train --workers 2 --strategy allreduce --lr-scaling none``, then evaluated on the workers. The last line
printed is a JSON summary: each model's local and nbdist loss curves, the largest weight difference, and
``nbdist.evaluate`` (what ``%dist_evaluate`` runs) beside ``model.evaluate``. BERT has dropout in its backbone and
ResNet BatchNorm (statistics per worker), so only GPT-2 (dropout 0) should equal the local fit to float32
rounding.
"""
from __future__ import annotations

import json

from IPython.testing.globalipapp import start_ipython

SETUP = '''
import numpy as np, keras, keras_hub
rng = np.random.default_rng(0)
n, seq = 256, 16
tokens = rng.integers(1, 100, (n, seq + 1)).astype("int32")
bert_x = {"token_ids": tokens[:, :-1], "segment_ids": np.zeros((n, seq), "int32"),
          "padding_mask": np.ones((n, seq), "int32")}
bert_y = (tokens[:, 0] > 50).astype("int32")
gpt_x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((n, seq), "int32")}
gpt_y, gpt_w = tokens[:, 1:], np.ones((n, seq), "float32")
images = (rng.random((96, 40, 40, 3)) * 255).astype("float32")
image_y = (images[:, :20].mean(axis=(1, 2, 3)) > images[:, 20:].mean(axis=(1, 2, 3))).astype("int32")

def bert():
    keras.utils.set_random_seed(1)
    backbone = keras_hub.models.BertBackbone(vocabulary_size=100, num_layers=2, num_heads=2, hidden_dim=32,
                                             intermediate_dim=64, max_sequence_length=seq)
    model = keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=2, preprocessor=None, dropout=0.0)
    model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model

def gpt():
    keras.utils.set_random_seed(1)
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=100, num_layers=2, num_heads=2, hidden_dim=16,
                                             intermediate_dim=32, max_sequence_length=seq, dropout=0.0)
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=["accuracy"])
    return model

def resnet():
    keras.utils.set_random_seed(1)
    backbone = keras_hub.models.ResNetBackbone(
        input_conv_filters=[64], input_conv_kernel_sizes=[3], stackwise_num_filters=[64, 64],
        stackwise_num_blocks=[1, 1], stackwise_num_strides=[1, 2], block_type="basic_block",
        use_pre_activation=False, image_shape=(32, 32, 3))
    preprocessor = keras_hub.models.ResNetImageClassifierPreprocessor(
        image_converter=keras_hub.layers.ResNetImageConverter(image_size=(32, 32), scale=1 / 255.0))
    model = keras_hub.models.ResNetImageClassifier(backbone=backbone, num_classes=2, preprocessor=preprocessor)
    model.compile(keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model

def gap(a, b):
    return max(float(np.max(np.abs(p - q))) for p, q in zip(a.get_weights(), b.get_weights()))
'''

# name: (its factory, the fit's arguments, the data it is evaluated on)
CASES = {
    "bert": ("bert", "bert_x, bert_y, batch_size=32, epochs=2, validation_split=0.25", "bert_x,bert_y"),
    "gpt2": ("gpt", "gpt_x, gpt_y, sample_weight=gpt_w, batch_size=32, epochs=2", "gpt_x,gpt_y"),
    "resnet": ("resnet", "images, image_y, batch_size=32, epochs=2", "images,image_y"),
}


def main() -> dict:
    ip = start_ipython()
    ip.run_line_magic("load_ext", "nbdist")
    ip.run_cell(SETUP)
    out = {}
    for name, (factory, arguments, data) in CASES.items():
        ip.run_cell(f"local = {factory}()\nlocal_h = local.fit({arguments}, shuffle=False, verbose=0)\n"
                    f"model = {factory}()")
        fit = ip.run_cell(f"%%dist_train --workers 2 --ui none --strategy allreduce --lr-scaling none\n"
                          f"h = model.fit({arguments}, shuffle=False, verbose=0)\n")
        row = {"fit_error": repr(fit.error_in_exec) if fit.error_in_exec else None}
        if not fit.error_in_exec:
            ns = ip.user_ns
            row.update(local_loss=ns["local_h"].history["loss"], nbdist_loss=ns["h"].history["loss"],
                       weight_gap=ip.ev("gap(local, model)"))
            x, y = data.split(",")
            got = ip.run_cell(f"import nbdist\ngot = nbdist.evaluate(model, {x}, {y}, workers=2)")
            row["evaluate_error"] = repr(got.error_in_exec) if got.error_in_exec else None
            row["evaluate_nbdist"] = {k: float(v) for k, v in ns.get("got", {}).items() if k in ("loss", "accuracy")}
            row["evaluate_local"] = ip.ev(f"model.evaluate({x}, {y}, verbose=0, return_dict=True)")
        out[name] = row
    return out


if __name__ == "__main__":
    print(json.dumps(main(), default=str))
