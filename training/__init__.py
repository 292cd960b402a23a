"""Reproducible training of the bundled zoo: one small byte-level model per positional scheme.

Every scheme gets the same data, architecture, hyper-parameters and seed, so that differences in
the extrapolation benchmark come from the positional encoding alone.
"""
