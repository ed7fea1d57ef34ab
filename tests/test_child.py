"""tests/child.py: a child that dies of a signal is rerun (with a warning), a failing one is not."""

from pathlib import Path

import child
import pytest

CRASH_ONCE = """
import os
from pathlib import Path

def test_crashes_once():
    runs = Path(__file__).with_suffix(".runs")
    n = int(runs.read_text()) if runs.exists() else 0
    runs.write_text(str(n + 1))
    if n == 0:
        os.abort()
"""

FAILS = """
from pathlib import Path

def test_fails():
    runs = Path(__file__).with_suffix(".runs")
    runs.write_text(str(int(runs.read_text()) + 1 if runs.exists() else 1))
    assert False, "a real failure"
"""


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_crashed_child_is_rerun_once(tmp_path):
    path = write(tmp_path, "test_crash_once.py", CRASH_ONCE)
    with pytest.warns(UserWarning, match="died of signal 6"):
        result = child.run_module(str(path), crash_retries=1)
    assert result.returncode == 0 and " passed" in result.stdout
    assert path.with_suffix(".runs").read_text() == "2"


def test_without_retries_the_crash_is_the_verdict(tmp_path):
    path = write(tmp_path, "test_crash_once.py", CRASH_ONCE)
    with pytest.warns(UserWarning, match="attempt 1 of 1"):
        result = child.run_module(str(path))
    assert result.returncode == -6


def test_a_failed_test_is_not_rerun(tmp_path):
    path = write(tmp_path, "test_fails.py", FAILS)
    result = child.run_module(str(path), crash_retries=3)
    assert result.returncode == 1 and "a real failure" in child.verdict(result)
    assert path.with_suffix(".runs").read_text() == "1"


def test_the_child_knows_it_is_one(tmp_path, monkeypatch):
    path = write(tmp_path, "test_env.py", "import child\n\ndef test_env():\n    assert child.in_child()\n")
    monkeypatch.delenv(child.CHILD_ENV, raising=False)
    assert not child.in_child()
    result = child.run_module(str(path), extra_env={"PYTHONPATH": str(Path(__file__).parent)})
    assert result.returncode == 0, child.verdict(result)


READS_FLAGS = """
import os

def test_sees_the_flags():
    assert os.environ["XLA_FLAGS"].split() == ["--xla_dump_hlo_as_text", "--xla_backend_optimization_level=0"]
"""


def test_a_child_gets_the_parents_xla_flags_and_the_added_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_hlo_as_text")
    path = write(tmp_path, "test_reads_flags.py", READS_FLAGS)
    result = child.run_module(str(path), extra_env=child.with_xla_flags(child.O0))
    assert result.returncode == 0 and " passed" in result.stdout, child.verdict(result)
