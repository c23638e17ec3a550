"""Benchmarks: lockstep's backends against the stock torch op, same device, same run."""
