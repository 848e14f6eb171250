"""``%%dist_train``: run the cell to build a model, train it on workers, write back the result.

``DistMagics`` also holds the session's settings, IPython configuration set once per notebook
(``%config DistMagics.ui = "text"``, ``c.DistMagics.ui = "text"`` in an IPython profile's config file, or a
kernel's ``--DistMagics.ui=text``): ``session_options`` hands them to every run of the magics as TrainConfig fields.
"""
from __future__ import annotations

import sys
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Bool, Float, TraitError, Unicode, observe, validate

from ..api import FitCall, check_training_line, fit_job, intercept_fit, is_keras_model, prepare, stop_warm_workers
from ..config import TrainConfig, implied_strategy
from ..errors import NbdistError, TrainingFailed
from .args import (
    apply,
    data_arguments,
    lookup_pair,
    tracking_arguments,
    tracking_options,
    train_worker_arguments,
    weight_col_argument,
)


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


# The session's settings (DistMagics' traits), by TrainConfig field.
SESSION_SETTINGS = ("ui", "warm_workers", "executor_wait", "advertise_host", "container_engine")


def session_options(shell: Any) -> dict[str, Any]:
    """The session's settings (``%config DistMagics.*``) as TrainConfig fields; the defaults where the
    extension is not loaded."""
    magics = shell.magics_manager.registry.get("DistMagics") if shell is not None else None
    if magics is None:
        return {}
    return {name: getattr(magics, name) for name in SESSION_SETTINGS}


@magics_class
class DistMagics(Magics):
    ui = Unicode("auto", help="the progress display of a run whose line gives no --ui: auto (widgets in "
                 "Jupyter, HTML in Zeppelin, else text), widgets, html, text or none; a headless kernel "
                 "sets text").tag(config=True)
    warm_workers = Bool(True, help="local workers fork from a fork server that has imported Keras, started "
                        "when the extension loads, and Spark executors keep warm workers; False: every "
                        "worker starts afresh").tag(config=True)
    executor_wait = Float(20.0, help="Spark: seconds to wait for executors with a task slot per worker "
                          "(a cluster that starts them on demand may need longer)").tag(config=True)
    advertise_host = Unicode(None, allow_none=True, help="Spark: this notebook's address as the executors "
                             "reach it (a NAT, a VPN); default: the driver's address on its route to "
                             "them").tag(config=True)
    container_engine = Unicode(None, allow_none=True, help="--backend containers: the podman or docker "
                               "binary (default: podman, else docker, on the PATH)").tag(config=True)

    @validate(*SESSION_SETTINGS)
    def _checked(self, proposal: Any) -> Any:
        """A bad value is refused with TrainConfig's sentence, when it is set rather than at the next run."""
        try:
            TrainConfig(**{proposal.trait.name: proposal.value})
        except NbdistError as exc:
            raise TraitError(str(exc)) from None
        return proposal.value

    @observe("warm_workers")
    def _warm_off(self, change: Any) -> None:
        if not change.new:  # the fork server the extension started is of no more use
            stop_warm_workers()

    @magic_arguments()
    @apply(data_arguments)
    @argument("--features", default=None, metavar="COLS",
              help="Spark DataFrame feature columns, comma-separated (numeric, array or ML Vector)")
    @argument("--label", default=None, metavar="COL", help="Spark DataFrame label column")
    @weight_col_argument
    @argument("--validation-data", metavar="Xv,yv", default=None,
              help="notebook variables for validation, evaluated after every epoch")
    @argument("--epochs", type=int, default=None,
              help="passes over the data (default: 1, or the cell's fit(epochs=...))")
    @argument("--batch-size", type=int, default=None,
              help="mini-batch size per worker (default: 32). A model.fit(batch_size=B) in the cell is instead "
                   "the global batch, split over the workers")
    @apply(train_worker_arguments)
    @argument("--strategy", default=None,
              help="allreduce | averaging | async (default: allreduce, the step local Keras takes; averaging, said "
                   "in one line, for a model whose train_step applies optimizers of its own, e.g. a GAN's two; "
                   "async: workers of unequal speed, blocks of batches to whoever is free, docs/async.md)")
    @argument("--max-staleness", type=int, default=None, metavar="S",
              help="--strategy async: refuse a block computed from shared weights more than S versions old "
                   "(default: 4 x workers)")
    @argument("--averaging-frequency", type=int, default=None, metavar="K",
              help="--strategy averaging: average parameters every K mini-batches (default: 5; given without "
                   "--strategy, the run averages); fewer messages than allreduce, for slow networks, but local "
                   "training between averages")
    @argument("--lr-scaling", default=None, metavar="auto|none|linear",
              help="multiply the learning rate by the number of workers: auto (adaptive optimizers "
                   "only; plain SGD keeps exact big-batch semantics), linear (always) or none. "
                   "Default: auto, but none for the cell's own model.fit, whose batch is global")
    @argument("--model", default=None, metavar="NAME",
              help="the model variable to train (default: the one Keras model the cell assigns)")
    @argument("--out", default=None, metavar="NAME",
              help="variable to receive per-epoch metrics (default: history; with the cell's own model.fit, "
                   "only when given: the cell's history = model.fit(...) is a keras History)")
    @argument("--seed", type=int, default=None,
              help="random seed; worker r uses seed + r (default: drawn from the notebook's Python and numpy "
                   "generators at the fit, so a cell seeded with keras.utils.set_random_seed reproduces)")
    @argument("--ui", default=None,
              help="auto | widgets | html | text | none (default: %%config DistMagics.ui, auto)")
    @argument("--checkpoint-dir", default=None, metavar="DIR",
              help="save weights, optimizer state and history here after every epoch")
    @argument("--resume", action="store_true", help="continue from the last checkpoint in --checkpoint-dir")
    @argument("--background", action="store_true", help="return at once; training continues")
    @argument("--max-restarts", type=int, default=0, metavar="N",
              help="when a worker fails, relaunch all workers from the last checkpoint, up to N times")
    @argument("--engine", default=None, help="collective engine: gloo | nccl | jax (JAX: summed in the step)")
    @apply(tracking_arguments)
    @argument("--stream-buffer", type=int, default=64, metavar="MIB",
              help="Spark data: MiB of rows each worker holds and shuffles together while it streams its "
                   "partition (default 64; lower it if workers run out of memory)")
    @argument("--image", default=None, help="container image for --backend containers")
    @argument("--cpus", type=float, default=None, help="CPUs per worker container (--backend containers)")
    @argument("--memory", default=None, help="memory per worker container, e.g. 2g (--backend containers)")
    @argument("--gpus", default=None,
              help="GPUs per worker container: all | 0,1 (Docker --gpus; Podman CDI, unverified)")
    @cell_magic
    def dist_train(self, line: str, cell: str) -> Any:
        """Train the Keras model this cell builds on several workers, data-parallel.

        Two forms. Put the magic line above an unchanged Keras cell that builds, compiles and
        calls ``model.fit(...)``: that call runs on the workers with all its arguments
        (callbacks, class_weight, sample_weight, validation_split, validation_data, shuffle,
        initial_epoch, dicts/lists of arrays for several inputs or outputs) and returns a
        ``keras.callbacks.History`` of the merged per-epoch metrics::

            %%dist_train --workers 2
            model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
            model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
            history = model.fit(X, y, batch_size=64, epochs=10, validation_split=0.1,
                                callbacks=[keras.callbacks.EarlyStopping(patience=2)])

        There ``batch_size`` is the GLOBAL batch, split over the workers (64 on 2 workers: 32
        each), so the cell trains as it would without the magic: the default ``--strategy
        allreduce`` averages every step's gradients over the workers, the step local Keras takes
        (a model whose own ``train_step`` applies optimizers besides ``model.optimizer`` trains with
        ``averaging`` instead, said in one line); ``--strategy averaging`` trains locally between
        averages every ``--averaging-frequency`` steps, fewer messages for slow networks. Magic
        options and fit arguments must agree (``--epochs 5`` with ``fit(epochs=10)`` is refused). Metrics are
        merged exactly from every worker's metric state. Callbacks run here, in the notebook,
        once per epoch with the merged logs and ``self.model`` holding the synchronised
        weights; their decisions (stop training, a new learning rate) reach every worker
        before the next epoch, and files they write land here. Batch-level callback hooks
        are not called.

        A ``keras.utils.PyDataset`` defined in the notebook may be fit's ``x`` or
        ``validation_data``: each worker reads its own share of the batch indices (worker r of
        N: r, r+N, ...), so a batch is the PyDataset's own batch and with 2 workers one step
        consumes 2 of them; ``--lr-scaling`` (auto by default) then scales the learning rate.
        A finite ``tf.data`` pipeline, or a torch ``DataLoader`` over a ``TensorDataset``, is read
        once here into the arrays it yields (its batch is the global batch, its shuffle the
        per-epoch shuffle); one that repeats forever or draws random numbers (augmentation in a
        ``map``) is refused in one sentence.

        Or name the data on the magic line and let the cell only build and compile the model
        (``--batch-size`` is then per worker)::

            %%dist_train --data X,y --epochs 20 --batch-size 32 --workers 2
            model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
            model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])

        When the cell returns, that model holds the trained weights and ``history`` (or
        ``--out``) holds the per-epoch metrics.

        Keras backends: the workers run the notebook's (``KERAS_BACKEND`` = tensorflow, jax or
        torch, set before ``import keras``); on JAX or torch neither the workers nor nbdist in the
        notebook import TensorFlow. Both strategies give the local step on every backend, locally,
        on Spark (classic and Connect) and in containers; tested with Keras 3.15.1 on TensorFlow 2.21,
        JAX 0.10.2 and torch 2.13 (CPU; on torch Keras <= 3.15 only). A masked loss (``mask_zero``,
        ``Masking``) is normalised by the global batch's valid entries on every backend.

        GPUs: each local worker sees one GPU (``CUDA_VISIBLE_DEVICES`` by rank, within the notebook's
        own); with GPUs and no ``--workers``, one worker per visible GPU; more workers than GPUs share
        them round-robin (JAX workers then allocate GPU memory as they go). One worker sums nothing.
        Engines (one choice, machine/engines.py): allreduce sums over NCCL only when every worker has a GPU of
        its own, else through host memory (shared memory on one machine, Gloo between machines), said in one
        line (``--engine nccl`` then refused in one sentence); on JAX, with a GPU per worker, JAX's own
        collectives inside the jitted step (``--engine jax``), else a host call (``--engine gloo`` by name).
        ``--strategy averaging`` averages on the GPUs under the same rule. Each worker's device and what summed
        it are in the dashboard and ``job.reports``. ``--engine horovod`` is gone (Horovod 0.28.1 does not
        build with TensorFlow >= 2.16). What differs
        on JAX and torch: one step per call into the backend, and dense gradients only. See
        docs/backends.md.

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
        # Typed on the magic line (vs left to the defaults): the cell's model.fit must agree with these.
        explicit = {k: getattr(args, k) for k in ("epochs", "batch_size", "data", "validation_data")
                    if getattr(args, k) is not None}
        out_given = args.out is not None
        args.out = args.out or "history"
        options = {
            **session_options(self.shell),
            "epochs": 1 if args.epochs is None else args.epochs,
            "batch_size": 32 if args.batch_size is None else args.batch_size, "workers": args.workers,
            "commit_every": args.commit_every,
            "strategy": args.strategy, "backend": args.backend,
            "averaging_frequency": args.averaging_frequency, "lr_scaling": args.lr_scaling or "auto",
            "max_staleness": args.max_staleness, "seed": args.seed, "ui": args.ui or self.ui,
            "checkpoint_dir": args.checkpoint_dir, "resume": args.resume, "background": args.background,
            "max_restarts": args.max_restarts, "engine": args.engine, "image": args.image,
            "container_cpus": args.cpus, "container_memory": args.memory, "container_gpus": args.gpus,
            **tracking_options(args),
            "stream_buffer_bytes": args.stream_buffer * 2**20 if args.stream_buffer > 0 else args.stream_buffer,
        }
        # Without --averaging-frequency TrainConfig's default; given alone it means averaging. The cell's
        # model.fit builds its config from these options too.
        options = implied_strategy({k: v for k, v in options.items() if k != "averaging_frequency" or v is not None})
        config = TrainConfig(**options)
        if not args.out.isidentifier():
            raise NbdistError(f"--out {args.out!r} is not a valid variable name; use e.g. --out history.")
        x = y = None
        if args.data is not None:
            x, y = lookup_pair(args.data, ns, "--data")
        validation = None
        if args.validation_data:
            xv, yv = lookup_pair(args.validation_data, ns, "--validation-data")
            validation = (xv, yv)
        # Before the cell runs, so a typo costs nothing: --data, the backend, MLflow, a hand-written loop.
        check_training_line(config, x, y, args.features, args.label, self.shell.transform_cell(cell),
                            args.weight_col)
        before = {name: id(value) for name, value in ns.items()}
        fit_calls: list[Any] = []
        runner = self._fit_runner(config, explicit, args, out_given, ns, fit_calls)
        with intercept_fit(runner) as outcome:
            result = self.shell.run_cell(cell, store_history=False, silent=False)
        if outcome.aborted:  # the cell's model.fit was refused or failed: report the cause, not a traceback
            cause = outcome.aborted[0]
            if isinstance(cause, KeyboardInterrupt):
                return None  # stop() ended every worker and kept the last synchronised weights
            raise cause
        error = result.error_in_exec
        if error is not None and any(error is e for e in outcome.raised):
            # What Keras (or the cell's code) raised out of its fit, shown above as the cell's error: the
            # magic's cell ends with it too, without showing it twice.
            error._render_traceback_ = _shown_above
            raise error
        if not result.success:
            if fit_calls:  # its model.fit trained on the workers before the error
                raise NbdistError("the cell raised an error (shown above) after its model.fit trained on the workers; "
                                  "the model holds the trained state, fix the code after fit and rerun it.")
            raise NbdistError("the cell raised an error (shown above) before training started; fix it and rerun.")
        if fit_calls:  # the cell's own model.fit ran on the workers: nothing more to train
            return None
        if args.data is None:
            raise NbdistError("--data is required unless the cell calls model.fit(...): name the notebook "
                              "variables to train on, e.g. --data X,y, or call model.fit(X, y) in the cell.")
        model = ns[self._pick_model(args.model, before, ns)]
        job = prepare(model, config, x, y, validation, namespace=ns, features=args.features, label=args.label,
                      weight_col=args.weight_col)
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

    def _fit_runner(self, config: TrainConfig, explicit: dict[str, Any], args: Any, out_given: bool,
                    ns: dict[str, Any], calls: list[Any]) -> Any:
        """What the cell's ``model.fit(...)`` does under the magic: train on the workers, return a History."""

        def run(model: Any, fit: FitCall) -> Any:
            job = fit_job(model, config, fit, explicit, args.lr_scaling is not None, namespace=ns)
            job.start()  # on this (main) thread: workers end with the thread that started them
            calls.append(job)
            ns[f"{args.out}_job"] = job
            if job.config.background:
                if out_given:
                    ns[args.out] = job.history
                return job.run_in_background().fit_history
            try:
                job.wait()
            except TrainingFailed as exc:
                self._show_failure(exc)
                raise
            finally:
                if out_given:
                    ns[args.out] = dict(job.history)
            return job.fit_history

        return run

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


def _shown_above() -> list[str]:
    """IPython's rendering of an error the cell's run showed already: nothing more."""
    return []
