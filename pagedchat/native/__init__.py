"""The CPU decode step in C: decode.c (the step), build.py (compiled once per machine, cached), step.py (bound to
a loaded model and its pool; the runner's fast path for plain decode steps)."""
