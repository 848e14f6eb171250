"""IPython magics: thin glue from a cell to ``nbdist.api``."""
from .evaluate import EvaluateMagics
from .train import DistMagics

__all__ = ["DistMagics", "EvaluateMagics"]
