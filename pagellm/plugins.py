"""Code of the operator's own, named by import path: custom logits processors (``--logits-processors``) and HTTP
middleware (``--middleware``). ``import_object("package.module:Name")`` (or ``package.module.Name``; a dotted name
after the colon reaches a nested attribute) imports the module and returns the object; anything wrong is a
ValueError that names the flag and says what to fix. ``run_file(path, flag)`` runs a plugin file once per process
(``--tool-parser-plugin``, ``--reasoning-parser-plugin``: the file registers parsers as it runs)."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

_FILES: set[Path] = set()  # plugin files run in this process


def run_file(path: str, flag: str) -> None:
    """Run the Python file ``path`` (once per process); ValueError naming ``flag`` when it is missing or fails."""
    file = Path(path).expanduser().resolve()
    if file in _FILES:
        return
    if not file.is_file():
        raise ValueError(f"{flag} {path}: no such file")
    spec = importlib.util.spec_from_file_location(f"pagellm_plugin_{len(_FILES)}", file)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except Exception as exc:  # the plugin's own error, whatever it is
        raise ValueError(f"{flag} {path} failed: {type(exc).__name__}: {exc}") from None
    _FILES.add(file)


def import_object(name: str, flag: str) -> Any:
    module_name, sep, attr = name.partition(":")
    if not sep:
        module_name, _, attr = name.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{flag} {name!r}: name it as package.module:Name")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{flag} {name!r} cannot be imported ({type(exc).__name__}: {exc}); it must be importable "
                         "by the server and its workers (on PYTHONPATH)") from None
    return target
