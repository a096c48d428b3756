"""What the data module accepts as a source, and the row it yields."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

# {"question": str | list[message], "answer": str, "source": str, "subject"?: str, "level"?: int, "columns"?: dict,
#  "instruction"?: str}
# A question is plain text or a conversation (a list of {"role", "content"} messages, formatted by the chat template);
# "columns" holds the record's own columns, which reach the reward functions; "instruction" replaces the data module's
# instruction for this row (the source's own prompt).
Row = dict


class PromptSource:
    """What the data module accepts as a source: iterating yields rows; ``stats`` counts what was read and skipped."""

    infinite: bool = False
    stats: Counter

    def __iter__(self) -> Iterator[Row]:
        raise NotImplementedError


def endless(source: PromptSource) -> Iterator[Row]:
    """Rows forever: a finite source starts again when it ends (``stats["epochs"]`` counts the restarts)."""
    while True:
        empty = True
        for row in source:
            empty = False
            yield row
        if empty:
            raise ValueError(f"{type(source).__name__} yielded no rows: check its files, split and filters.")
        source.stats["epochs"] += 1
