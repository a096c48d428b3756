"""The scripts of ``docs/experiments`` are no package: load them by path, as ``python docs/experiments/x.py`` would."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

EXPERIMENTS = Path(__file__).resolve().parents[2] / "docs" / "experiments"


def load_script(name: str):
    """The module ``docs/experiments/<name>.py`` (registered in ``sys.modules``, as its siblings import it)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
