"""IPython magics: thin glue from a cell to ``nbdist.api``."""
from .train import DistMagics

__all__ = ["DistMagics"]
