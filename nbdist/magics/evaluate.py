"""``%dist_evaluate`` and ``%dist_predict``: thin glue from a line to ``nbdist.api``'s evaluate and predict."""
from __future__ import annotations

import sys
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from ..api import evaluate, is_spark_data, labels_in_batches, named_frames, predict
from ..errors import NbdistError, TrainingFailed
from .args import apply, data_arguments, lookup_pair, weight_col_argument, worker_arguments
from .train import session_options

_batch = argument("--batch-size", type=int, default=256, help="rows per batch on each worker (default: 256)")
_features = argument("--features", default=None, metavar="COLS",
                     help="Spark DataFrame feature columns, comma-separated (numeric, array or ML Vector)")


def _model(name: str, ns: dict[str, Any]) -> Any:
    if not name.isidentifier():
        raise NbdistError(f"{name!r} is not a variable name; write e.g. %dist_evaluate model --data X,y.")
    if name not in ns:
        raise NbdistError(f"no variable named {name!r} in the notebook; train or load the model first.")
    return ns[name]


def _out(name: str) -> str:
    if not name.isidentifier():
        raise NbdistError(f"--out {name!r} is not a valid variable name; use e.g. --out evaluation.")
    return name


def _run(fn: Any) -> Any:
    try:
        return fn()
    except TrainingFailed as exc:
        if exc.worker_traceback:
            sys.stderr.write(f"--- traceback from worker {exc.rank} ---\n{exc.worker_traceback.rstrip()}\n")
        raise UsageError(str(exc)) from None
    except NbdistError as exc:
        raise UsageError(str(exc)) from None


@magics_class
class EvaluateMagics(Magics):
    def _session(self) -> dict[str, Any]:
        """The session's settings (%config DistMagics.*) but its ui: inference shows its result, not progress."""
        return {k: v for k, v in session_options(self.shell).items() if k != "ui"}

    def _inputs(self, magic: Any, line: str) -> tuple[Any, dict[str, Any], str, Any, tuple[Any, Any]]:
        """What both magics read from their line: the arguments, the notebook namespace, the --out
        name, the model and the --data pair, each checked in that order."""
        args = parse_argstring(magic, line)
        ns = self.shell.user_ns
        out = _out(args.out)
        model = _model(args.model, ns)
        x, y = lookup_pair(args.data, ns, "--data")
        x, _ = named_frames(x, None, args.features, getattr(args, "label", None))  # pandas-on-Spark: its Spark frame
        return args, ns, out, model, (x, y)

    @magic_arguments()
    @argument("model", help="the notebook variable holding the trained, compiled Keras model")
    @apply(data_arguments)
    @apply(worker_arguments)
    @_batch
    @_features
    @argument("--label", default=None, metavar="COL", help="Spark DataFrame label column")
    @weight_col_argument
    @argument("--sample-weight", default=None, metavar="W",
              help="notebook variable holding per-row weights (an array, or a dict or list per output), "
                   "as model.evaluate's sample_weight")
    @argument("--out", default="evaluation", metavar="NAME",
              help="variable to receive the result dict (default: evaluation)")
    @line_magic
    def dist_evaluate(self, line: str) -> None:
        """Evaluate a model sharded over workers; metrics are merged exactly, never averaged.

        Shows the model's compiled metrics and, for classifiers, per-class
        precision/recall/F1 and a confusion matrix; stores the result dict in
        ``evaluation`` (or ``--out``).

        Example::

            %dist_evaluate model --data X_test,y_test --workers 2
            %dist_evaluate model --data test_df --features pixels --label digit
            %dist_evaluate model --data test_df --features pixels --label digit --weight-col w
            %dist_evaluate model --data ds      # a keras.utils.PyDataset or tf.data pipeline of (x, y) batches
        """
        _run(lambda: self._evaluate(line))

    def _evaluate(self, line: str) -> None:
        from IPython.display import display

        from ..ui.report import EvaluationReport

        args, ns, out, model, (x, y) = self._inputs(self.dist_evaluate, line)
        # A PyDataset's or an input pipeline's batches hold the labels.
        if y is None and not labels_in_batches(x):
            raise NbdistError("--data needs features and labels to evaluate; write it as --data X,y.")
        weights = None
        if args.sample_weight is not None:
            weights, extra = lookup_pair(args.sample_weight, ns, "--sample-weight")
            if extra is not None:
                raise NbdistError("--sample-weight names one notebook variable (a dict or list for several "
                                  "outputs), e.g. --sample-weight w.")
        result = evaluate(model, x, y, sample_weight=weights, namespace=ns, workers=args.workers,
                          backend=args.backend, batch_size=args.batch_size, features=args.features,
                          label=args.label, weight_col=args.weight_col, **self._session())
        ns[out] = result
        display(EvaluationReport(result))

    @magic_arguments()
    @argument("model", help="the notebook variable holding the trained Keras model")
    @apply(data_arguments)
    @apply(worker_arguments)
    @_batch
    @_features
    @argument("--prediction-col", default="prediction", metavar="COL",
              help="Spark DataFrame input: name of the prediction column to add (default: prediction)")
    @argument("--out", default="predictions", metavar="NAME",
              help="variable to receive the predictions (default: predictions)")
    @line_magic
    def dist_predict(self, line: str) -> None:
        """Predict with a model sharded over workers; rows come back in input order.

        Example::

            %dist_predict model --data X_new --out y_pred
            %dist_predict model --data new_df --features pixels --out scored_df
            %dist_predict model --data ds --out y_pred   # a keras.utils.PyDataset, rows in its order

        A Spark DataFrame gets a new DataFrame with a prediction column, computed
        lazily on the executors (rows never reach the notebook).
        """
        _run(lambda: self._predict(line))

    def _predict(self, line: str) -> None:
        args, ns, out, model, (x, y) = self._inputs(self.dist_predict, line)
        if y is not None:
            raise NbdistError("--data for %dist_predict names only the features, e.g. --data X.")
        result = predict(model, x, namespace=ns, workers=args.workers, backend=args.backend,
                         batch_size=args.batch_size, features=args.features, prediction_col=args.prediction_col,
                         **self._session())
        ns[out] = result
        if is_spark_data(result):
            print(f"{out}: a Spark DataFrame with column {args.prediction_col!r}, computed on the executors "
                  "when you use it")
            return
        shape = getattr(result, "shape", None)
        print(f"{out}: predictions of shape {shape} in input order")
