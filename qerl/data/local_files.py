"""Records of local ``.jsonl`` / ``.json`` / ``.parquet`` files, one at a time, each with where it came from.

A line that is not a JSON object does not stop the reading (pyarrow's JSON reader, behind ``datasets``, fails the
whole file on the first one): it comes out as ``(location, None)`` so the caller can skip and count it.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from pathlib import Path

SUFFIXES = (".jsonl", ".json", ".parquet")


def expand(data_files: str | list[str]) -> list[Path]:
    """The files ``data_files`` names (``~`` and globs expanded, sorted per pattern); a pattern matching nothing is an
    error."""
    files = []
    for pattern in [data_files] if isinstance(data_files, str) else data_files:
        matches = sorted(glob.glob(str(Path(pattern).expanduser())))  # ~/data/... as verl's examples write
        if not matches:
            raise FileNotFoundError(
                f"data_files: no file matches {pattern!r} (relative to {Path.cwd()}). "
                "Fix: give an existing .jsonl/.json/.parquet path, or drop data_files to stream from the hub."
            )
        files.extend(Path(m) for m in matches)
    return files


def read_records(path: Path) -> Iterator[tuple[str, dict | None]]:
    """``(position, record)`` for every record of one file; ``record`` is ``None`` where it cannot be read.

    Positions are ``"line <n>"`` for JSON lines (1-based, as editors count), ``"item <i>"`` for the items of a JSON
    array file and ``"row <i>"`` for parquet (0-based, as pandas and pyarrow count).
    """
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # a dependency of datasets; only where parquet is read

        index = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                yield f"row {index}", record
                index += 1
        return
    with path.open(encoding="utf-8", errors="replace") as f:
        head = f.read(4096).lstrip()
        f.seek(0)
        if head.startswith("["):  # a .json file holding one array of records
            try:
                items = json.load(f)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{path} starts like a JSON array but is not valid JSON ({error}). Fix: repair it, or write one "
                    "JSON object per line (.jsonl) so a bad line costs one row, not the file."
                ) from None
            for i, item in enumerate(items):
                yield f"item {i}", item if isinstance(item, dict) else None
            return
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            yield f"line {number}", record if isinstance(record, dict) else None
