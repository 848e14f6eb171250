"""The package version, in a module of its own so that config need not import the package root."""

__version__ = "0.1.0"
