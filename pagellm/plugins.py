"""Code of the operator's own, named by import path: custom logits processors (``--logits-processors``) and HTTP
middleware (``--middleware``). ``import_object("package.module:Name")`` (or ``package.module.Name``; a dotted name
after the colon reaches a nested attribute) imports the module and returns the object; anything wrong is a
ValueError that names the flag and says what to fix."""

from __future__ import annotations

import importlib
from typing import Any


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
