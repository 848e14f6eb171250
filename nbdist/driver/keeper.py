"""A run's checkpoints as the driver keeps them: where training starts, where a restart resumes.

``TrainingJob`` owns one ``CheckpointKeeper`` when the run has ``--checkpoint-dir``,
``--resume`` or ``--max-restarts``. The keeper decides the starting point (the
model as given, or the checkpoint being resumed), writes a checkpoint after every
completed epoch, counts restarts and gives the point a restart continues from.
With ``--max-restarts`` but no directory, checkpoints go to a temporary directory
that is removed when the run ends. The file format lives in checkpoint.py.
"""
from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
from typing import Any

import numpy as np

from ..config import TrainConfig
from ..errors import NbdistError
from ..model.spec import ModelSpec
from . import checkpoint
from .state import RunState

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ModelInfo:
    """What a checkpoint must match, read from the notebook's model."""

    shapes: list[tuple[int, ...]]
    names: list[str]
    optimizer: str

    @classmethod
    def of(cls, model: Any) -> ModelInfo:
        return cls([tuple(int(d) for d in w.shape) for w in model.weights],
                   [str(getattr(w, "path", w.name)) for w in model.weights],
                   type(model.optimizer).__name__)

    @property
    def fingerprint(self) -> str:
        return checkpoint.model_signature(self.shapes, self.optimizer)


class CheckpointKeeper:
    def __init__(self, directory: str, temporary: bool, config: TrainConfig, info: ModelInfo,
                 resumed: checkpoint.Checkpoint | None) -> None:
        self.directory = directory
        self.temporary = temporary
        self.config = config
        self.info = info
        self.resumed = resumed
        self.max_restarts = config.max_restarts
        self.restarts = 0
        self.saved = 0  # checkpoints this run wrote
        self.iterations: int | None = resumed.iterations if resumed else None  # optimizer step to start at
        self.base_spec: ModelSpec | None = None

    @classmethod
    def for_run(cls, config: TrainConfig, model: Any) -> CheckpointKeeper | None:
        """The keeper for this run, or None when it neither checkpoints nor restarts.

        Everything the user could get wrong is checked here, before any worker starts.
        """
        if config.checkpoint_dir is None and config.max_restarts == 0:
            return None
        info = ModelInfo.of(model)
        if config.checkpoint_dir is None:
            return cls(tempfile.mkdtemp(prefix="nbdist-ckpt-"), True, config, info, None)
        directory = checkpoint.prepare_dir(config.checkpoint_dir)
        resumed = None
        if config.resume:
            resumed = checkpoint.load(directory)
            checkpoint.check_matches(resumed, directory, info.shapes, info.names, info.optimizer)
            if resumed.epoch >= config.epochs:
                raise NbdistError(f"the checkpoint in {directory} already holds {resumed.epoch} epochs and "
                                  f"--epochs is {config.epochs}; raise --epochs above {resumed.epoch} "
                                  "to train further.")
            if resumed.config_fingerprint and resumed.config_fingerprint != _config_fingerprint(config):
                log.info("resuming with different settings than the checkpoint's: %s", resumed.config)
        elif checkpoint.exists(directory):
            log.warning("%s holds a checkpoint that this run will replace after its first epoch; "
                        "add --resume to continue it instead", directory)
        return cls(directory, False, config, info, resumed)

    # -- where training starts ------------------------------------------
    def start_point(self, spec: ModelSpec) -> tuple[ModelSpec, int]:
        """The spec to send and the initial epoch: the model as given, or the resumed checkpoint."""
        self.base_spec = spec
        if self.resumed is None:
            return spec, 0
        return _with_state(spec, self.resumed), self.resumed.epoch

    def seed_state(self, state: RunState) -> None:
        """A resumed run's state starts with the checkpoint's epochs and history."""
        if self.resumed is not None:
            state.initial_epoch = self.resumed.epoch
            for key, values in self.resumed.history.items():
                state.history[key] = list(values)

    # -- after every epoch ----------------------------------------------
    def save(self, epochs_done: int, weights: list[np.ndarray], optimizer_weights: list[np.ndarray],
             iterations: int | None, history: dict[str, list[float]], world_size: int,
             buffers: list[np.ndarray] | None = None) -> None:
        settings = _config_dict(self.config)
        ckpt = checkpoint.Checkpoint(
            epoch=epochs_done, weights=list(weights), optimizer_weights=list(optimizer_weights or []),
            iterations=iterations, history={k: list(v[:epochs_done]) for k, v in history.items()},
            buffers=list(buffers or []),
            weight_names=self.info.names, optimizer=self.info.optimizer,
            model_fingerprint=self.info.fingerprint, config={**settings, "world_size": world_size},
            config_fingerprint=checkpoint.fingerprint(settings))
        checkpoint.save(self.directory, ckpt)
        self.saved += 1

    # -- restarts -------------------------------------------------------
    def can_restart(self) -> bool:
        return self.restarts < self.max_restarts

    def restart_point(self) -> tuple[ModelSpec, int]:
        """Count a restart; the spec and initial epoch to relaunch from (read back from disk)."""
        self.restarts += 1
        assert self.base_spec is not None
        if self.saved or self.resumed is not None:
            ckpt = checkpoint.load(self.directory)
            self.iterations = ckpt.iterations
            return _with_state(self.base_spec, ckpt), ckpt.epoch
        return self.base_spec, 0  # no epoch finished: start over from the model as given

    def restart_reason(self, cause: str, epoch: int) -> str:
        where = (f"from the checkpoint after epoch {epoch}" if self.saved or self.resumed is not None
                 else "from the start (no epoch had finished)")
        return f"{cause}; restart {self.restarts} of {self.max_restarts}, {where}"

    def close(self) -> None:
        """The run ended: a temporary checkpoint directory goes with it."""
        if self.temporary:
            shutil.rmtree(self.directory, ignore_errors=True)


def _with_state(spec: ModelSpec, ckpt: checkpoint.Checkpoint) -> ModelSpec:
    return dataclasses.replace(spec, weights=ckpt.weights, optimizer_weights=ckpt.optimizer_weights,
                               iterations=ckpt.iterations, buffers=ckpt.buffers or None)


def _config_dict(config: TrainConfig) -> dict[str, Any]:
    return {k: getattr(config, k) for k in checkpoint.CONFIG_FIELDS}


def _config_fingerprint(config: TrainConfig) -> str:
    return checkpoint.fingerprint(_config_dict(config))
