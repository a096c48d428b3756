"""What the command line tells a user who got something wrong: one ``error:`` line naming the option or file, the
problem and the fix (the closest valid option for a typo, the valid classes of a class option, the file and line of a
YAML error, the checkpoints that exist where ``--ckpt_path`` points), checked before anything loads."""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
import sys
from pathlib import Path

from lightning.pytorch.cli import LightningArgumentParser

from qerl.run.renamed_options import renamed_hints


class QeRLArgumentParser(LightningArgumentParser):
    """Errors as one line (``error: ...``) instead of the full usage, with the closest valid option for a typo;
    ``--model.optimizer.lr -1e-5`` read as a value (argparse's own pattern knows no exponent, so it took it for an
    option)."""

    NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = self.NEGATIVE_NUMBER

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:
            return super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        options = [s for action in parser._actions for s in action.option_strings if s.startswith("--")]
        hints = []
        for unknown in re.findall(r"(?:--|[Kk]ey \"|option ')([\w.]+)", message):
            unknown = unknown if unknown.startswith("--") else f"--{unknown}"
            close = difflib.get_close_matches(unknown, options, n=1, cutoff=0.6) if unknown not in options else []
            if close:
                hints.append(f"did you mean {close[0]}?")
        hints = renamed_hints(message) or hints + init_arg_hints(message) + class_hints(message)
        hint = f" ({'; '.join(hints)})" if hints else ""
        prog = parser.prog.replace(" [options]", "")
        sys.stderr.write(f"error: {short_error(message)}{hint}\nAll options: {prog} --help\n")
        self.exit(2)


def init_arg_hints(message: str) -> list[str]:
    """``did you mean eps_low?`` for an init argument a class given by ``class_path`` does not take."""
    owner = re.search(r"class_path '([\w.]+)'", message)
    unknown = re.findall(r"Option '(\w+)' is not accepted", message)
    if not owner or not unknown:
        return []
    module, _, name = owner[1].rpartition(".")
    try:
        accepted = list(inspect.signature(getattr(importlib.import_module(module), name)).parameters)
    except (ImportError, AttributeError, TypeError, ValueError):
        return []
    return [f"did you mean {close[0]}?" for u in unknown if (close := difflib.get_close_matches(u, accepted, n=1))]


CLASS_OPTIONS = {  # option -> (module of the classes it takes, their base class)
    "model.loss": ("qerl.modules.loss", "PolicyLoss"),
    "model.advantage": ("qerl.modules.advantages", "Advantage"),
    "model.rollout": ("qerl.rollout.base", "RolloutEngine"),
}


def class_hints(message: str) -> list[str]:
    """``use one of qerl.modules.loss.DAPOLoss, ...`` for a class option whose value names no class it takes."""
    option = re.match(r'\s*(?:Parser key ")?([\w.]+)"?:', message)
    if not option or option[1] not in CLASS_OPTIONS or not message.lstrip().startswith('Parser key') \
            or "class_path" in message and "not accepted" in message:
        return []
    module, base = CLASS_OPTIONS[option[1]]
    base = getattr(importlib.import_module(module), base)
    names = sorted(f"{c.__module__}.{c.__qualname__}" for c in all_subclasses(base) if not inspect.isabstract(c))
    return [f"use one of {', '.join(names)}"] if names else []


def all_subclasses(cls: type) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *all_subclasses(sub))]


def yaml_problem(path: str) -> str | None:
    """The error line for a ``--config`` file that is not valid YAML: the file, the line and column, what is wrong."""
    import yaml

    try:
        yaml.safe_load(Path(path).read_text())
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "somewhere"
        context = f" ({error.context} at line {error.context_mark.line + 1})" if error.context and \
            error.context_mark and error.problem_mark else ""
        return f"--config {path}: not valid YAML at {where}: {error.problem or error.context}{context}."
    except (OSError, UnicodeDecodeError, yaml.YAMLError):  # unreadable: the parser's own error names it
        return None
    return None


def config_files(argv: list[str]) -> list[str]:
    """The files ``--config X`` / ``--config=X`` name, in order."""
    files = [value for flag, value in zip(argv, argv[1:]) if flag == "--config"]
    return files + [arg.removeprefix("--config=") for arg in argv if arg.startswith("--config=")]


def short_error(message: str) -> str:
    """The part of a jsonargparse error that says what is wrong: the first reason of a union's errors (not the
    ``None`` alternative's) with the option it concerns, or a type error as ``option=value: expected <type>``."""
    message = re.sub(r"^Call to compute_fn of link .*? failed: ", "", message.strip(), flags=re.DOTALL)  # our own
    lines = [line for line in message.strip().splitlines() if line.strip()]
    key = re.match(r'Parser key "([\w.]+)":', lines[0].strip()) if lines else None
    reasons = []
    for i, line in enumerate(lines):
        if line.strip().startswith("- "):
            indent, parts = len(line) - len(line.lstrip()), [line.strip()[2:]]
            for more in lines[i + 1 :]:
                if len(more) - len(more.lstrip()) <= indent:
                    break
                parts.append(more.strip())
            reasons.append(" ".join(parts))
    reasons = [r for r in reasons if not r.startswith("Expected a <class 'NoneType'>")]
    if reasons:
        return (f"{key[1]}: " if key and not reasons[0].startswith(key[1]) else "") + reasons[0]
    text = " ".join(line.strip() for line in lines)
    typed = re.match(r'Parser key "([\w.]+)": Expected a <class \'(\w+)\'>\. Got value: (.*)', text)
    if typed:
        return f"{typed[1]}={typed[3]}: expected a value of type {typed[2]}."
    return " ".join(line.strip() for line in lines[:2]) if lines else "invalid arguments"


LIGHTNING_CHECKPOINT_NAMES = ("last", "best", "hpc")  # --ckpt_path values Lightning resolves itself


def checkpoint_path_problem(ckpt_path: str | None) -> str | None:
    """The error line for a ``--ckpt_path`` that names no checkpoint file (with the checkpoints that exist where it
    points), or None when it does (or is one of Lightning's own names, or a remote URL)."""
    if not ckpt_path or ckpt_path in LIGHTNING_CHECKPOINT_NAMES or "://" in ckpt_path or \
            ckpt_path.startswith("registry"):
        return None
    path = Path(ckpt_path).expanduser()
    if path.is_file():
        return None
    folder = path if path.is_dir() else path.parent
    if (folder / "checkpoints").is_dir():
        folder = folder / "checkpoints"
    problem = "is a folder" if path.is_dir() else "no such file"
    if not folder.is_dir():
        return f"--ckpt_path={ckpt_path}: {problem}, and no folder {folder}; pass a .ckpt file a run wrote."
    found = sorted(p.name for p in folder.glob("*.ckpt"))
    listed = f"checkpoints in {folder}: {', '.join(found)}" if found else f"no .ckpt file in {folder}"
    return f"--ckpt_path={ckpt_path}: {problem} ({listed})."
