"""Moved to kvflow.paths.relay (issue 41): this name keeps working for code
that imported RelayGroup from here (kvflow.RelayGroup is the public name)."""
from kvflow.paths.relay import RelayGroup

__all__ = ["RelayGroup"]
