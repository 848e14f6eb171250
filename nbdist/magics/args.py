"""Argument bundles shared by the magics, and how their values are looked up."""
from __future__ import annotations

from typing import Any

from IPython.core.magic_arguments import argument

from ..errors import NbdistError

# Decorators are applied bottom-up; these bundles keep the order readable.
data_arguments = [
    argument("--data", metavar="X,y", required=False,
             help="notebook variables holding features and labels, e.g. --data X,y"),
]

# A Spark DataFrame's column of per-row weights: %%dist_train and %dist_evaluate (weight_col= in the API).
weight_col_argument = argument(
    "--weight-col", default=None, metavar="COL",
    help="Spark DataFrame column of per-row weights, used as model.fit's / model.evaluate's sample_weight")

worker_arguments = [
    argument("--workers", type=int, default=None, help="workers (local default: one per visible GPU, else 2)"),
    argument("--backend", default="auto", help="auto | local | spark | containers (default: auto)"),
]



def workers_option(text: str) -> int | str:
    """``--workers`` of %%dist_train: a number, or ``MIN:MAX`` (an elastic run; TrainConfig reads and checks it)."""
    return int(text) if text.strip().isdigit() else text


# %%dist_train's: --workers MIN:MAX too (an elastic run, docs/elastic.md).
train_worker_arguments = [
    argument("--workers", type=workers_option, default=None, metavar="N|MIN:MAX",
             help="workers (local default: one per visible GPU, else 2); MIN:MAX: start with MAX and go on "
                  "without a lost worker while MIN are left (allreduce, docs/elastic.md)"),
    argument("--commit-every", type=int, default=None, metavar="K",
             help="with --workers MIN:MAX: commit every K steps as well as at each epoch start, so a lost worker "
                  "costs at most K steps (default: epoch starts only)"),
    worker_arguments[1],
]

# MLflow tracking (nbdist/ui/tracking.py); %%dist_train and %%dist_tune share them.
tracking_arguments = [
    argument("--mlflow", dest="mlflow", action="store_const", const=True, default=None,
             help="log this run to MLflow (default: when the notebook uses MLflow: a tracking URI set, "
                  "autologging on, or a run active)"),
    argument("--no-mlflow", dest="mlflow", action="store_const", const=False,
             help="log nothing to MLflow, even when the notebook uses it"),
    argument("--run-name", default=None, metavar="NAME", help="the MLflow run's name"),
    argument("--mlflow-active", default="nest", metavar="nest|use",
             help="an MLflow run active in the notebook becomes this run's parent (nest, default) "
                  "or receives its logs (use)"),
]


def tracking_options(args: Any) -> dict[str, Any]:
    """The TrainConfig fields of ``tracking_arguments``."""
    return {"mlflow": args.mlflow, "run_name": args.run_name, "mlflow_active": args.mlflow_active}


def apply(decorators: list[Any]):
    def wrap(func):
        for deco in reversed(decorators):
            func = deco(func)
        return func

    return wrap


def lookup_pair(spec: str | None, namespace: dict[str, Any], option: str) -> tuple[Any, Any]:
    """Resolve ``"X,y"`` (or a single name) to the notebook's objects, one clear sentence if not."""
    if not spec:
        raise NbdistError(f"{option} is required: name the notebook variables to use, e.g. {option} X,y.")
    names = [n.strip() for n in spec.split(",")]
    if len(names) > 2 or not all(n.isidentifier() for n in names):
        raise NbdistError(f"{option} {spec!r} is not one or two variable names; write it as {option} X,y.")
    values = []
    for name in names:
        if name not in namespace:
            raise NbdistError(f"{option}: no variable named {name!r} in the notebook; define it first "
                              "or check the spelling.")
        values.append(namespace[name])
    return values[0], values[1] if len(values) == 2 else None
