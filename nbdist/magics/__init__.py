"""IPython magics: thin glue from a cell to ``nbdist.api``.

train.py: ``%%dist_train``: run the cell to build a model, train it on workers, write back the result.
evaluate.py: ``%dist_evaluate`` and ``%dist_predict``.
tune.py: ``%%dist_tune``: a search whose trials are nbdist runs (``nbdist.search.entry.tune``).
args.py: argument bundles shared by the magics, and how their values are looked up.
"""
from .evaluate import EvaluateMagics
from .train import DistMagics
from .tune import TuneMagics

__all__ = ["DistMagics", "EvaluateMagics", "TuneMagics"]
