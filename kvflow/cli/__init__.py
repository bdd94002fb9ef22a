"""Command-line tools: kvflow-bench (bench) and kvflow-info (info)."""
