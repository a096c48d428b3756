"""Counting the rows a source cannot use, per reason, with where the first few are: what the user is told at start.

A file with a few bad rows trains on the rest and says so once; a file where most rows are bad is refused with the
same report (wrong columns or a wrong parser are far likelier than a mostly broken file).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

# reason -> what it means in the report. ``filtered`` (a level or solve-rate filter) is a choice, not a bad row.
SKIP_REASONS = {
    "unreadable_line": "not a JSON object",
    "missing_question": "no question",
    "missing_answer": "no answer",
    "no_final_answer": "an answer without its final-answer marker",
}


class SkipReport:
    """Rows seen and rows skipped per reason in one pass over some files, with the first ``examples`` positions.

    Args:
        examples: Positions kept per reason for the report.
    """

    def __init__(self, examples: int = 5):
        self.examples = examples
        self.rows = 0
        self.counts: Counter[str] = Counter()
        self.positions: dict[str, list[tuple[Path, str]]] = {}

    def add(self, path: Path, position: str, reason: str | None = None) -> None:
        """Count one row of ``path`` at ``position``; ``reason`` (a ``SKIP_REASONS`` key) when it is skipped."""
        self.rows += 1
        if reason is not None:
            self.counts[reason] += 1
            kept = self.positions.setdefault(reason, [])
            if len(kept) < self.examples:
                kept.append((path, position))

    @property
    def skipped(self) -> int:
        return sum(self.counts.values())

    def summary(self, label: str, hint: str = "") -> str:
        """One paragraph: ``<label>: skipped 3 of 10 rows: 2 unreadable_line (not a JSON object: line 2, line 7)``;
        positions name their file when the rows come from several."""
        files = {path for kept in self.positions.values() for path, _ in kept}
        parts = []
        for reason, count in self.counts.most_common():
            where = [position if len(files) == 1 else f"{path} {position}" for path, position in self.positions[reason]]
            more = ", ..." if count > len(where) else ""
            meaning = SKIP_REASONS[reason] + (f" {hint}" if reason == "no_final_answer" and hint else "")
            parts.append(f"{count} {reason} ({meaning}: {', '.join(where)}{more})")
        return f"{label}: skipped {self.skipped} of {self.rows} rows: " + "; ".join(parts) + "."

    def check(self, label: str, max_fraction: float = 0.5, hint: str = "") -> str | None:
        """Raise ``ValueError`` with the report when no row or more than ``max_fraction`` of the rows is unusable;
        otherwise return the report (``None`` when nothing was skipped)."""
        if self.rows == 0:
            raise ValueError(f"{label}: the file has no rows. Fix: point data_files at a file with one JSON object "
                             "per line.")
        if self.skipped > max_fraction * self.rows:
            raise ValueError(
                self.summary(label, hint) + " Most rows are unusable, so the file is refused. Fix: check that it is "
                "the file you meant, and that question_field / answer_field (and answer_parser) match its columns."
            )
        return self.summary(label, hint) if self.skipped else None
