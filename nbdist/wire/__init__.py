"""nbdist.wire."""
