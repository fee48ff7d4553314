"""The commands behind ``python -m minizero``: demo, doctor, bench (and its reports), simulate,
and the parsers they share (cli.py). Tools import the library, never the course; the course's own
commands (start, grade, lessons, compare) live in :mod:`minizero.course`."""
