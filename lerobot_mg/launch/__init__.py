"""Launch-environment helpers: the run directory every rank agrees on."""
