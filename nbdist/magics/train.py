"""``%%dist_train``: run the cell to build a model, train it on workers, write back the result."""
from __future__ import annotations

import sys
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from ..config import TrainConfig
from ..errors import NbdistError, TrainingFailed
from ..model_io import is_keras_model
from .args import apply, data_arguments, lookup_pair, worker_arguments


def _new_models(before: dict[str, int], namespace: dict[str, Any]) -> list[str]:
    """Names the cell bound (or rebound) to a Keras model."""
    return [name for name, value in namespace.items()
            if not name.startswith("_") and before.get(name) != id(value) and is_keras_model(value)]


def continue_in_empty_cell(lines: list[str]) -> list[str]:
    """``%%dist_train --model NAME`` alone in its cell trains NAME further. IPython refuses a cell
    magic with an empty body before calling it, so this input transformer gives it ``pass``."""
    if lines and lines[0].lstrip().startswith("%%dist_train") and not "".join(lines[1:]).strip():
        return [lines[0].rstrip("\n") + "\n", "pass\n"]
    return lines


@magics_class
class DistMagics(Magics):
    @magic_arguments()
    @apply(data_arguments)
    @argument("--features", default=None, metavar="COLS",
              help="Spark DataFrame feature columns, comma-separated (numeric, array or ML Vector)")
    @argument("--label", default=None, metavar="COL", help="Spark DataFrame label column")
    @argument("--validation-data", metavar="Xv,yv", default=None,
              help="notebook variables for validation, evaluated after every epoch")
    @argument("--epochs", type=int, default=1, help="passes over the data (default: 1)")
    @argument("--batch-size", type=int, default=32, help="mini-batch size per worker (default: 32)")
    @apply(worker_arguments)
    @argument("--strategy", default="averaging", help="averaging | allreduce (default: averaging)")
    @argument("--averaging-frequency", type=int, default=5, metavar="K",
              help="average parameters every K mini-batches (default: 5)")
    @argument("--lr-scaling", default="auto", metavar="auto|none|linear",
              help="multiply the learning rate by the number of workers: auto (adaptive optimizers "
                   "only; plain SGD keeps exact big-batch semantics), linear (always) or none")
    @argument("--model", default=None, metavar="NAME",
              help="the model variable to train (default: the one Keras model the cell assigns)")
    @argument("--out", default="history", metavar="NAME",
              help="variable to receive per-epoch metrics (default: history)")
    @argument("--seed", type=int, default=None, help="random seed; worker r uses seed + r")
    @argument("--ui", default="auto", help="auto | widgets | html | text | none (default: auto)")
    @argument("--checkpoint-dir", default=None, metavar="DIR",
              help="save weights, optimizer state and history here after every epoch")
    @argument("--resume", action="store_true", help="continue from the last checkpoint in --checkpoint-dir")
    @argument("--background", action="store_true", help="return at once; training continues")
    @argument("--max-restarts", type=int, default=0, metavar="N",
              help="when a worker fails, relaunch all workers from the last checkpoint, up to N times")
    @argument("--engine", default=None, help="collective engine: gloo | nccl | horovod")
    @argument("--image", default=None, help="container image for --backend containers")
    @argument("--cpus", type=float, default=None, help="CPUs per worker container (--backend containers)")
    @argument("--memory", default=None, help="memory per worker container, e.g. 2g (--backend containers)")
    @argument("--gpus", default=None,
              help="GPUs per worker container: all | 0,1 (Docker --gpus; Podman CDI, unverified)")
    @cell_magic
    def dist_train(self, line: str, cell: str) -> Any:
        """Train the Keras model this cell builds on several workers, data-parallel.

        The cell runs in the notebook's namespace and must build and compile one
        Keras model. When the cell returns, that model holds the trained weights
        and ``history`` (or ``--out``) holds the per-epoch metrics, averaged over
        workers weighted by samples.

        Example::

            %%dist_train --data X,y --epochs 20 --batch-size 32 --workers 2
            model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
            model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])

        Every run's ``TrainingJob`` is stored in the notebook as ``<out>_job``
        (``history_job`` by default): after a failure, ``job.error`` and
        ``job.worker_log(rank)`` tell what happened. With ``--background`` the cell
        returns at once and its value is the running job. ``--out`` then holds the history as it
        grows; ``job.wait()`` blocks until the end, ``job.stop()`` (or the dashboard's Stop
        button) ends every worker and keeps the last averaged weights; ``job.history`` and
        ``job.status`` tell where it is. When the run ends, the model holds the trained weights
        and ``--out`` a copy of the history.
        """
        try:
            return self._train(line, cell)
        except NbdistError as exc:
            raise UsageError(str(exc)) from None

    def _train(self, line: str, cell: str) -> Any:
        args = parse_argstring(self.dist_train, line)
        ns = self.shell.user_ns
        options = {
            "epochs": args.epochs, "batch_size": args.batch_size, "workers": args.workers,
            "strategy": args.strategy, "backend": args.backend,
            "averaging_frequency": args.averaging_frequency, "lr_scaling": args.lr_scaling, "seed": args.seed,
            "ui": args.ui,
            "checkpoint_dir": args.checkpoint_dir, "resume": args.resume, "background": args.background,
            "max_restarts": args.max_restarts, "engine": args.engine, "image": args.image,
            "container_cpus": args.cpus, "container_memory": args.memory, "container_gpus": args.gpus,
        }
        config = TrainConfig(**options)
        if not args.out.isidentifier():
            raise NbdistError(f"--out {args.out!r} is not a valid variable name; use e.g. --out history.")
        x, y = lookup_pair(args.data, ns, "--data")
        validation = None
        if args.validation_data:
            xv, yv = lookup_pair(args.validation_data, ns, "--validation-data")
            validation = (xv, yv)
        from ..api import prepare, training_data

        # Check the data before running the cell, so a typo costs nothing (Spark: schema only).
        training_data(x, y, args.features, args.label)
        from ..driver.resolve import resolve_backend

        resolve_backend(config)  # e.g. --backend spark with no SparkContext: say so before the cell runs

        before = {name: id(value) for name, value in ns.items()}
        result = self.shell.run_cell(cell, store_history=False, silent=False)
        if not result.success:
            raise NbdistError("the cell raised an error (shown above) before training started; fix it and rerun.")
        model = ns[self._pick_model(args.model, before, ns)]
        job = prepare(model, config, x, y, validation, namespace=ns, features=args.features, label=args.label)
        job.start()  # on this (main) thread: workers end with the thread that started them
        ns[f"{args.out}_job"] = job  # also when blocking: after a failure, job.error and job.worker_log(rank)
        if config.background:
            return self._in_background(job, ns, args.out)
        try:
            job.wait()
        except TrainingFailed as exc:
            self._show_failure(exc)
            raise
        except KeyboardInterrupt:
            pass  # stop() ended every worker and kept the last averaged weights; the renderer said so
        finally:
            ns[args.out] = dict(job.history)

    @staticmethod
    def _in_background(job: Any, ns: dict[str, Any], out: str) -> Any:
        def write_back(kind: str, state: Any, payload: Any) -> None:
            if kind == "end":
                ns[out] = dict(state.history)

        job.listeners.append(write_back)
        ns[out] = job.history  # the live dict: it grows epoch by epoch
        ns[f"{out}_job"] = job
        return job.run_in_background()

    @staticmethod
    def _pick_model(name: str | None, before: dict[str, int], ns: dict[str, Any]) -> str:
        if name is not None:
            if name not in ns:
                raise NbdistError(f"--model {name}: no variable named {name!r} after running the cell; "
                                  "check the name the cell assigns.")
            if not is_keras_model(ns[name]):
                raise NbdistError(f"--model {name} is a {type(ns[name]).__name__}, not a Keras model.")
            return name
        names = _new_models(before, ns)
        if not names:
            raise NbdistError("the cell assigned no Keras model; build and compile one in the cell, "
                              "e.g. model = keras.Sequential([...]), or name an existing one with --model NAME.")
        if len(names) > 1:
            raise NbdistError(f"the cell assigned {len(names)} Keras models ({', '.join(names)}); "
                              "name the one to train with --model NAME.")
        return names[0]

    @staticmethod
    def _show_failure(exc: TrainingFailed) -> None:
        if exc.worker_traceback:
            sys.stderr.write(f"--- traceback from worker {exc.rank} ---\n{exc.worker_traceback.rstrip()}\n")
            sys.stderr.flush()
