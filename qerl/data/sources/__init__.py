"""Prompt sources: iterables of rows ``{"question", "answer", "source"}`` (+ ``"subject"``, ``"level"``,
``"columns"``), one concept per module; every source is importable from here (``qerl.data.sources.GSM8K`` in YAML).

- ``base``: the ``PromptSource`` protocol, the row, ``endless`` (cycles a finite source).
- ``hub``: ``HubSource``, any hub dataset (streamed) or local jsonl / json / parquet files in its schema, with
  mappable column names and the filters of the reference recipes (solve-rate range, level); ``fields`` reads a
  record's columns (dotted names, conversations, levels).
- ``presets``: the hub datasets of the reference recipes (``GSM8K``, ``MATH500``, ``MATH``, ``BigMath``,
  ``BigMathProcessed``).
- ``competitions``: the sets reasoning-RL papers report (``AIME2024``, ``AIME2025``, ``AMC2023``), with lighteval's
  prompt (``LIGHTEVAL_MATH_PROMPT``).
- ``trainer_formats``: other trainers' dataset formats (``TRLPrompts``, ``VerlParquet``).
- ``arithmetic``, ``expressions``: the embedded generators (``ArithmeticSource``, the CPU default;
  ``ArithmeticExpressions``, with a held-out part that training never draws from).
- ``mixture``: ``Mixture``, weighted interleaving of sources.
- ``few_shot``: ``FewShot``, another source's questions after worked examples (earlier turns of the conversation).

A source yields one pass over its data (``infinite`` sources never stop). Rows it cannot use (a line that is not JSON,
a missing question or answer, a GSM8K answer without ``####``) are skipped and counted per reason in ``source.stats``
(once per row of the data, not once per pass), never raised. Local files are read once when the source is built: a
few bad rows give one warning with their file and line numbers, a file where most rows are bad is refused with the
same report, before any model loads.
"""

from qerl.data.sources.arithmetic import ArithmeticSource, evaluate
from qerl.data.sources.base import PromptSource, Row, endless
from qerl.data.sources.competitions import AIME2024, AIME2025, AMC2023, LIGHTEVAL_MATH_PROMPT
from qerl.data.sources.expressions import ArithmeticExpressions, heldout_position
from qerl.data.sources.few_shot import FewShot
from qerl.data.sources.fields import conversation, field
from qerl.data.sources.hub import HubSource
from qerl.data.sources.mixture import Mixture
from qerl.data.sources.presets import GSM8K, MATH, MATH500, BigMath, BigMathProcessed
from qerl.data.sources.trainer_formats import TRLPrompts, VerlParquet

__all__ = [
    "AIME2024", "AIME2025", "AMC2023", "FewShot", "GSM8K", "LIGHTEVAL_MATH_PROMPT", "MATH", "MATH500",
    "ArithmeticExpressions", "ArithmeticSource", "BigMath", "BigMathProcessed", "HubSource", "Mixture", "PromptSource", "Row", "TRLPrompts",
    "VerlParquet", "conversation", "endless", "evaluate", "field", "heldout_position",
]
