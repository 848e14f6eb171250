"""IPython magics: thin glue from a cell to ``nbdist.api``."""
from .evaluate import EvaluateMagics
from .train import DistMagics
from .tune import TuneMagics

__all__ = ["DistMagics", "EvaluateMagics", "TuneMagics"]
