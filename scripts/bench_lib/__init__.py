"""Helpers of scripts/bench.py: one concept per module (see each module's docstring)."""
