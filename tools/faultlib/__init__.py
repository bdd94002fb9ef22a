"""The parts of tools/faults.py (the script keeps the case list, the table
and the command line, and is what the namespace processes run). Imported
with tools/ on sys.path, as tools/faults.py puts it."""
