"""``%%dist_tune``: thin glue from a cell to ``nbdist.search.entry.tune`` (a search whose trials are nbdist runs)."""
from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from ..config import implied_strategy
from ..errors import NbdistError
from .args import apply, data_arguments, lookup_pair, tracking_arguments, tracking_options
from .train import _new_models, session_options


@magics_class
class TuneMagics(Magics):
    @magic_arguments()
    @argument("--trials", type=int, default=None, metavar="N",
              help="trials the study should have finished (a resumed study's earlier ones count; default: 10, "
                   "said in the first line)")
    @argument("--parallel", type=int, default=2, metavar="P", help="trials running at once (default: 2)")
    @argument("--objective", default="val_loss", metavar="METRIC",
              help="the merged metric to optimise, its value at the last epoch (default: val_loss)")
    @argument("--direction", default=None, metavar="maximize|minimize",
              help="default: minimize a loss or an error, maximize anything else")
    @argument("--workers-per-trial", type=int, default=1, metavar="W", help="workers of each trial (default: 1)")
    @argument("--storage", default=None, metavar="URL",
              help="Optuna's RDB storage of the study (default: sqlite:///nbdist_tune.db); the same URL and "
                   "--study resume an interrupted search")
    @argument("--study", default=None, metavar="NAME", help="the study's name in the storage (default: nbdist-tune)")
    @argument("--models-dir", default=None, metavar="DIR|none",
              help="where each complete trial's model is saved (trial-N.keras under DIR/<study>), so that a resumed "
                   "search has best_model; default: <db>_models/ beside an SQLite storage's file; none: not saved")
    @argument("--pruner", default="median", metavar="NAME",
              help="median (default) | percentile | hyperband | successive-halving | none, or the name of a "
                   "notebook variable holding an Optuna pruner")
    @argument("--sampler", default=None, metavar="NAME",
              help="a notebook variable holding an Optuna sampler (default: TPE, seeded with --seed)")
    @argument("--ensemble", type=int, default=None, metavar="N",
              help="also leave best_ensemble: one Keras model averaging the predictions of the best N trials' "
                   "models (soft voting for a classifier)")
    @apply(data_arguments)
    @argument("--validation-data", metavar="Xv,yv", default=None, help="notebook variables for validation")
    @argument("--epochs", type=int, default=None, help="epochs of each trial (default: 1, or the cell's fit)")
    @argument("--batch-size", type=int, default=None, help="mini-batch size per worker")
    @argument("--backend", default="auto", help="auto | local | spark | containers (default: auto)")
    @argument("--strategy", default=None, help="allreduce | averaging | async (default: allreduce, as %%%%dist_train)")
    @argument("--averaging-frequency", type=int, default=None, metavar="K",
              help="steps between averaging rounds; given without --strategy, the trials average (default: 5)")
    @argument("--lr-scaling", default=None, metavar="auto|none|linear")
    @argument("--seed", type=int, default=None, help="seeds the sampler and every trial's workers")
    @argument("--ui", default=None,
              help="auto | html | text | none: the table of trials (default: %%config DistMagics.ui, auto)")
    @apply(tracking_arguments)
    @cell_magic
    def dist_tune(self, line: str, cell: str) -> Any:
        """Search hyperparameters: run this cell once per Optuna trial, several trials at once.

        The cell sees Optuna's ``Trial`` as ``trial``; it builds and compiles a model with
        ``trial.suggest_float(...)``, ``trial.suggest_int(...)``, ... and calls ``model.fit(...)``
        (or names the data with ``--data X,y``)::

            %%dist_tune --trials 12 --parallel 2 --objective val_accuracy --direction maximize
            lr = trial.suggest_float("lr", 1e-4, 1e-1, log=True)
            model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(trial.suggest_int("units", 16, 128)),
                                      keras.layers.Dense(10, activation="softmax")])
            model.compile(keras.optimizers.Adam(lr), "sparse_categorical_crossentropy", metrics=["accuracy"])
            model.fit(X, y, epochs=5, batch_size=64, validation_split=0.2)

        Each trial is an nbdist run on ``--workers-per-trial`` workers; the cell runs up to its
        ``model.fit`` (that call is the trial's run; what follows it does not run). After each epoch
        the merged ``--objective`` is reported to Optuna, whose pruner may stop the trial's workers
        at once. Without ``--trials`` the study runs until it has 10 finished trials, said in the
        first line (keras-tuner's default, and TPE's random start). The study is kept in
        ``--storage`` (an SQLite file by default), so rerunning the
        cell after an interrupt resumes it. Afterwards the notebook holds ``study``, ``best_model``
        (the best trial's trained model) and ``best_params``; ``tune_search`` is the search; with
        ``--ensemble N`` also ``best_ensemble``, the best N trials' models averaged as one Keras model.
        With MLflow tracking on, the search is a run and each trial a child run.
        """
        try:
            return self._tune(line, cell)
        except NbdistError as exc:
            raise UsageError(str(exc)) from None

    def _tune(self, line: str, cell: str) -> Any:
        from ..search.entry import make_search
        from ..search.scheduler import FitCaptured
        from ..search.study import import_optuna

        args = parse_argstring(self.dist_tune, line)
        import_optuna()  # not installed: one sentence before anything runs
        ns = self.shell.user_ns
        explicit = {k: getattr(args, k) for k in ("epochs", "batch_size", "data", "validation_data")
                    if getattr(args, k) is not None}
        x = y = validation = None
        if args.data is not None:
            x, y = lookup_pair(args.data, ns, "--data")
        if args.validation_data:
            validation = lookup_pair(args.validation_data, ns, "--validation-data")
        session = session_options(self.shell)
        options = {**session, "epochs": 1 if args.epochs is None else args.epochs,
                   "batch_size": 32 if args.batch_size is None else args.batch_size,
                   "backend": args.backend, "strategy": args.strategy,
                   "averaging_frequency": args.averaging_frequency, "lr_scaling": args.lr_scaling or "auto",
                   "seed": args.seed, "ui": args.ui or session.get("ui", "auto"), **tracking_options(args)}
        options = implied_strategy({k: v for k, v in options.items() if k != "averaging_frequency" or v is not None})
        pruner = self._object(args.pruner, ns, "--pruner") if args.pruner in ns else args.pruner
        sampler = self._object(args.sampler, ns, "--sampler") if args.sampler else None

        # Run as IPython would (magics and ! lines inside it transformed), but not through run_cell: the
        # cell ends at its model.fit by an exception, which run_cell would record as an error output.
        source = self.shell.transform_cell(cell)
        code = self.shell.compile(source, self.shell.compile.cache(source), "exec")

        def build(trial: Any) -> Any:
            before = {name: id(value) for name, value in ns.items()}
            ns["trial"] = trial
            try:
                exec(code, ns)
            except (FitCaptured, KeyboardInterrupt):
                raise  # FitCaptured: the cell reached model.fit, whose arguments are the trial's run
            except Exception:
                self.shell.showtraceback()
                raise NbdistError(f"the cell raised an error (shown above) in trial {trial.number}; fix it and "
                                  "rerun (the study keeps the trials that finished).") from None
            names = [n for n in _new_models(before, ns) if n != "trial"]
            if len(names) != 1:
                raise NbdistError(f"trial {trial.number}'s cell called no model.fit(...) and assigned "
                                  f"{len(names) or 'no'} Keras model(s); call model.fit(...) in the cell, or "
                                  "assign one compiled model and pass --data X,y.")
            return ns[names[0]]

        search = make_search(build, trials=args.trials, parallel=args.parallel, objective=args.objective,
                             direction=args.direction, workers_per_trial=args.workers_per_trial,
                             storage=args.storage, study_name=args.study, pruner=pruner,
                             models_dir=False if (args.models_dir or "").lower() == "none" else args.models_dir,
                             sampler=sampler, ensemble=args.ensemble, x=x, y=y,
                             validation_data=validation, namespace=ns, explicit=explicit,
                             lr_scaling_given=args.lr_scaling is not None, **options)
        try:
            search.run()
        except KeyboardInterrupt:
            pass  # every trial's workers stopped; the storage marks the trials it cut short
        finally:  # also after an interrupt or a failed cell: what finished is the notebook's
            ns.update(study=search.study, best_model=search.best_model, best_params=search.best_params,
                      tune_search=search)
            if args.ensemble:
                ns["best_ensemble"] = search.best_ensemble
        return None

    @staticmethod
    def _object(name: str, ns: dict[str, Any], option: str) -> Any:
        if name not in ns:
            raise NbdistError(f"{option} {name}: no variable named {name!r} in the notebook.")
        return ns[name]
