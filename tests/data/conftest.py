from pathlib import Path

import pytest

# Real GSM8K / MATH-500 files beside the checkout (<repo>/../shared/data); a fresh clone has none, so tests using
# them skip.
SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not (SHARED_DATA / "gsm8k" / "test.jsonl").exists():
        pytest.skip(f"no real benchmark data at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tokenizer():
    from qerl.hub import EMBEDDED_MODEL, load_tokenizer

    return load_tokenizer(EMBEDDED_MODEL)
