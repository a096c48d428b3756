"""Code the config names: ``package.module:name``, ``package.module.name`` or ``path/to/file.py:name`` (reward
functions, tools, environments). Below everything that reads such names; the callers word the errors."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

LOAD_ERRORS = (ImportError, AttributeError, FileNotFoundError, SyntaxError)  # what ``import_named`` raises


def split_name(spec: str) -> tuple[str, str] | None:
    """``(module or file, name)`` of ``spec``, or None when it names no attribute of a module."""
    module_name, sep, name = spec.rpartition(":") if ":" in spec else spec.rpartition(".")
    return (module_name, name) if sep and module_name and name else None


def import_named(module_name: str, name: str, prefix: str = "qerl_user"):
    """``name`` of the module ``module_name`` (a file when it ends with ``.py``, imported as ``<prefix>_<stem>``);
    raises one of ``LOAD_ERRORS``."""
    if module_name.endswith(".py"):
        path = Path(module_name).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"no file {path}")
        spec = importlib.util.spec_from_file_location(f"{prefix}_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    return getattr(module, name)
