"""Scheduling: which connection or device serves a slice, and how failed
ones come back (rails: the tcp rail watcher)."""
