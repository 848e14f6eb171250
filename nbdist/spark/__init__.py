"""nbdist.spark."""
