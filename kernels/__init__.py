"""Compute kernels. ``kernels.reference`` is the readable definition of every strict spec;
``kernels.oracle`` holds the float64 oracles used for the accuracy level A."""
