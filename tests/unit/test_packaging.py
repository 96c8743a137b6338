"""pyproject.toml's package data: an installed (non-editable) pagellm carries every file it reads at run time
besides its modules: the native sources it compiles on first use (without them the scheduler's and the sampler's
fast paths fall back to Python with a warning) and the dashboard's static files."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_non_python_file_of_the_package_is_package_data():
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["pagellm"]
    package = ROOT / "pagellm"
    shipped = {path for pattern in patterns for path in package.glob(pattern)}
    needed = {path for path in package.rglob("*") if path.is_file() and path.suffix not in (".py", ".pyc")
              and "__pycache__" not in path.parts}
    assert needed, "the package has native sources and static files"
    assert sorted(str(p.relative_to(package)) for p in needed - shipped) == []
