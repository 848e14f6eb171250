"""The worker program every backend starts: ``python -m nbdist.worker``."""
