"""The parts of tools/soak.py (the script keeps the run itself: soak(),
quiesce() and the command line). Imported with tools/ on sys.path, as
tools/soak.py puts it."""
