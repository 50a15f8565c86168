"""Example models (plain Flax NNX with logical axis names)."""
