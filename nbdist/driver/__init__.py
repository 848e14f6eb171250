"""nbdist.driver."""
