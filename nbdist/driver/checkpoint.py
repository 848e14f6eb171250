"""Checkpoints on disk: one npz file per directory, replaced atomically after every epoch.

A checkpoint holds the synchronised weights, the torch modules' buffers, the optimizer's state (slots, step
count), the history so far and a fingerprint of the model and of the run's configuration. It is written to a temporary
file in the same directory, fsynced and renamed over the previous one (``os.replace``, atomic on POSIX), so
a crash at any moment leaves the previous checkpoint or the new one, never half of one. No pickle: arrays in
npz (read with ``allow_pickle=False``), everything else as JSON in the same file. Pure file logic: no Keras,
no sockets; ``model_signature`` takes plain shapes.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import NbdistError

FILENAME = "nbdist-checkpoint.npz"
FORMAT = 1
_TMP_PREFIX = ".nbdist-checkpoint-"
_TMP_SUFFIX = ".tmp"
# Fields of TrainConfig that define what a run computes (not how it is shown or where it runs).
# --epochs is left out: resuming with more epochs is the point.
CONFIG_FIELDS = ("batch_size", "workers", "strategy", "averaging_frequency", "average_optimizer",
                 "lr_scaling", "seed", "shuffle")


@dataclass
class Checkpoint:
    epoch: int  # epochs completed: the next run starts at this (0-based) epoch
    weights: list[np.ndarray]
    optimizer_weights: list[np.ndarray]
    iterations: int | None
    history: dict[str, list[float]]
    buffers: list[np.ndarray] = field(default_factory=list)  # torch modules' buffers (model/tensors.py)
    weight_names: list[str] = field(default_factory=list)
    optimizer: str = ""  # the optimizer's class name
    model_fingerprint: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    config_fingerprint: str = ""
    written_at: float = 0.0


def fingerprint(obj: Any) -> str:
    """A short stable hash of JSON-able data."""
    text = json.dumps(obj, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def model_signature(weight_shapes: Sequence[Sequence[int]], optimizer: str) -> str:
    """What must match for a checkpoint to fit a model: weight shapes in order, optimizer class."""
    return fingerprint({"shapes": [list(s) for s in weight_shapes], "optimizer": optimizer})


def path_in(directory: str | os.PathLike) -> str:
    return os.path.join(os.fspath(directory), FILENAME)


def prepare_dir(directory: str | os.PathLike) -> str:
    """Create the directory if needed and check that a checkpoint can be written there."""
    d = os.path.abspath(os.path.expanduser(os.fspath(directory)))
    if os.path.exists(d) and not os.path.isdir(d):
        raise NbdistError(f"--checkpoint-dir {d} is a file, not a directory; name a directory.")
    try:
        os.makedirs(d, exist_ok=True)
    except OSError as exc:
        raise NbdistError(f"--checkpoint-dir {d} cannot be created ({exc.strerror}); "
                          "choose a directory you can write to.") from None
    if not os.access(d, os.W_OK | os.X_OK):
        raise NbdistError(f"--checkpoint-dir {d} is not writable; choose a directory you can write to.")
    return d


def save(directory: str | os.PathLike, ckpt: Checkpoint) -> str:
    """Write ``ckpt`` atomically as the directory's one checkpoint; return its path."""
    d = os.fspath(directory)
    meta = {
        "format": FORMAT, "epoch": int(ckpt.epoch),
        "iterations": None if ckpt.iterations is None else int(ckpt.iterations),
        "history": {k: [float(v) for v in vals] for k, vals in ckpt.history.items()},
        "weight_names": list(ckpt.weight_names), "optimizer": ckpt.optimizer,
        "model_fingerprint": ckpt.model_fingerprint, "config": ckpt.config,
        "config_fingerprint": ckpt.config_fingerprint,
        "n_weights": len(ckpt.weights), "n_optimizer": len(ckpt.optimizer_weights), "n_buffers": len(ckpt.buffers),
        "written_at": time.time(),
    }
    arrays: dict[str, Any] = {"meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)}
    arrays.update({f"w{i:05d}": w for i, w in enumerate(ckpt.weights)})
    arrays.update({f"o{i:05d}": w for i, w in enumerate(ckpt.optimizer_weights)})
    arrays.update({f"b{i:05d}": b for i, b in enumerate(ckpt.buffers)})
    _remove_stale_temps(d)
    fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=_TMP_SUFFIX, dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        final = path_in(d)
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(d)  # the rename itself survives a power cut
    return final


def exists(directory: str | os.PathLike) -> bool:
    return os.path.isfile(path_in(directory))


def load(directory: str | os.PathLike) -> Checkpoint:
    """The directory's checkpoint; one sentence if there is none or it cannot be read."""
    d = os.fspath(directory)
    path = path_in(d)
    if not os.path.isfile(path):
        raise NbdistError(f"--resume: there is no checkpoint in {d}; train once with --checkpoint-dir {d} "
                          "(without --resume) first, or drop --resume.")
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(z["meta"].tobytes().decode())
            if meta.get("format") != FORMAT:
                raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT}")
            weights = [z[f"w{i:05d}"] for i in range(int(meta["n_weights"]))]
            opt = [z[f"o{i:05d}"] for i in range(int(meta["n_optimizer"]))]
            buffers = [z[f"b{i:05d}"] for i in range(int(meta.get("n_buffers", 0)))]
    except Exception as exc:
        raise NbdistError(f"the checkpoint {path} cannot be read ({exc}); it was not written by this "
                          "version of nbdist - remove it or use another --checkpoint-dir.") from None
    return Checkpoint(epoch=int(meta["epoch"]), weights=weights, optimizer_weights=opt,
                      iterations=meta.get("iterations"), history=meta.get("history", {}), buffers=buffers,
                      weight_names=meta.get("weight_names", []), optimizer=meta.get("optimizer", ""),
                      model_fingerprint=meta.get("model_fingerprint", ""), config=meta.get("config", {}),
                      config_fingerprint=meta.get("config_fingerprint", ""),
                      written_at=float(meta.get("written_at", 0.0)))


def check_matches(ckpt: Checkpoint, directory: str, weight_shapes: Sequence[Sequence[int]],
                  weight_names: Sequence[str], optimizer: str) -> None:
    """Refuse, in one sentence, a checkpoint written by a differently shaped model or optimizer."""
    fix = "resume with the model that wrote it, or use another --checkpoint-dir"
    if len(ckpt.weights) != len(weight_shapes):
        raise NbdistError(f"the checkpoint in {directory} does not match this model: it holds "
                          f"{len(ckpt.weights)} weight tensors but the model has {len(weight_shapes)}; {fix}.")
    for i, (saved, shape) in enumerate(zip(ckpt.weights, weight_shapes)):
        if tuple(saved.shape) != tuple(shape):
            name = weight_names[i] if i < len(weight_names) else f"weight {i}"
            raise NbdistError(f"the checkpoint in {directory} does not match this model: {name} has shape "
                              f"{tuple(saved.shape)} in the checkpoint but {tuple(shape)} in the model; {fix}.")
    if ckpt.optimizer and optimizer and ckpt.optimizer != optimizer:
        raise NbdistError(f"the checkpoint in {directory} holds {ckpt.optimizer} optimizer state but the model "
                          f"is compiled with {optimizer}; compile it with {ckpt.optimizer} to resume, or use "
                          "another --checkpoint-dir.")


def _remove_stale_temps(directory: str) -> None:
    """Temp files a crashed writer left behind are never read; clear them before writing anew."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if name.startswith(_TMP_PREFIX) and name.endswith(_TMP_SUFFIX):
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
