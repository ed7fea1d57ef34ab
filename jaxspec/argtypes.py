"""argparse types whose errors name the argument, and output-path checks made before long work
starts; shared by the `jaxspec` commands (cli, spec.calibration, bench.sweep)."""

import argparse
import os


def output_file_problem(path) -> str | None:
    """Why a file cannot be written at `path` (a directory, a missing or unwritable directory), or None."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{path!r} is a directory"
    if not os.path.isdir(directory):
        return f"{path!r}: directory {directory!r} does not exist"
    if not os.access(directory, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return f"{path!r} is not writable"
    return None


def output_dir_problem(path) -> str | None:
    """Why directory `path` cannot be created or written (its nearest existing ancestor is a file or
    unwritable), or None."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{path!r}: {existing!r} is not a directory"
    if not os.access(existing, os.W_OK):
        return f"{path!r}: {existing!r} is not writable"
    return None


def bounded(name, cast, kind, rule, ok):
    """argparse type: `cast` of the text, kept only where ok(value); messages name the argument."""

    def parse(text):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be {kind}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{name} must be {rule}, got {value}")
        return value

    return parse


def positive_int(name):
    return bounded(name, int, "an int", ">= 1", lambda v: v >= 1)


def non_negative_int(name):
    return bounded(name, int, "an int", ">= 0", lambda v: v >= 0)


def positive_float(name):
    return bounded(name, float, "a number", "> 0", lambda v: v > 0)


def non_negative_float(name):
    return bounded(name, float, "a number", ">= 0", lambda v: v >= 0)
