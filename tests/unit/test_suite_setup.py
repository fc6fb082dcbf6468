"""How the suite runs (docs/testing.md): the README's test command spreads it over pytest-xdist workers a
file at a time, the files holding ``slow`` tests first, and every mark a test uses is registered."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _pytest_line() -> list[str]:
    lines = [line for line in (REPO / "scripts" / "test.sh").read_text().splitlines() if "-m pytest" in line]
    assert len(lines) == 1, lines
    return shlex.split(lines[0])


def test_the_readme_command_runs_the_suite_on_four_workers_a_file_at_a_time() -> None:
    argv = _pytest_line()
    assert argv[0] == "exec" and argv[-1] == "$@"  # .ci/run gets pytest's exit code and summary line
    n = argv.index("-n")
    assert argv[n + 1] == "4"
    assert argv[argv.index("--dist") + 1] == "loadfile" and "--no-loadscope-reorder" in argv
    dev = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    assert any(re.match(r"pytest-xdist\b", dep) for dep in dev)
    docs = " ".join((REPO / "docs" / "testing.md").read_text().split())
    assert "-n 4 --dist loadfile --no-loadscope-reorder" in docs


def test_every_mark_the_tests_use_is_registered() -> None:
    ini = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    registered = {m.split(":", 1)[0] for m in ini["markers"]}
    assert {"integration", "slow"} <= registered
    builtin = {"parametrize", "timeout", "skipif", "skip", "xfail", "usefixtures", "filterwarnings"}
    used = set()
    for path in (REPO / "tests").rglob("*.py"):
        used |= set(re.findall(r"pytest\.mark\.(\w+)", path.read_text()))
    assert used - builtin <= registered, used - builtin - registered
    assert "--strict-markers" in ini["addopts"]  # a misspelt mark fails collection, not silently nothing


def test_files_with_the_most_slow_tests_are_handed_out_first(tmp_path: Path) -> None:
    """One worker runs the files in the order the scheduler hands them out: the files with the most slow
    tests first, each file's own tests in their order."""
    (tmp_path / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\n")
    (tmp_path / "test_a.py").write_text("def test_a1():\n    pass\n\n\ndef test_a2():\n    pass\n")
    (tmp_path / "test_b.py").write_text("import pytest\n\n\ndef test_b1():\n    pass\n\n\n"
                                        "@pytest.mark.slow\ndef test_b2():\n    pass\n")
    (tmp_path / "test_c.py").write_text("import pytest\n\n\n@pytest.mark.slow\n@pytest.mark.parametrize('i', [1, 2])\n"
                                        "def test_c(i):\n    pass\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-n", "1", "--dist",
                          "loadfile", "--no-loadscope-reorder", "-o", "addopts="], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    ran = re.findall(r"PASSED (test_\w\.py::test_\w\d?(?:\[\d\])?)", out.stdout)
    assert ran == ["test_c.py::test_c[1]", "test_c.py::test_c[2]", "test_b.py::test_b1", "test_b.py::test_b2",
                   "test_a.py::test_a1", "test_a.py::test_a2"], out.stdout
