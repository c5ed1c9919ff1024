"""Write prompts.parquet, the example prompt set: generated here, never downloaded.

Single-digit sums and differences in a dataset of its own shape, the way a user's data
arrives: the prompt in `question`, the reference answer in `solution` (an integer), and extra
columns (`op`, `difficulty`) that only the user's reward reads. Run it again to regenerate
the file (`python recipes/examples/make_prompts.py`); the rows depend only on the seed.
"""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROWS = 400
OUT = Path(__file__).with_name("prompts.parquet")


def rows(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(ROWS):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        if rng.random() < 0.5:
            out.append({"question": f"{a}+{b}=", "solution": a + b, "op": "+"})
        else:
            a, b = max(a, b), min(a, b)
            out.append({"question": f"{a}-{b}=", "solution": a - b, "op": "-"})
        out[-1]["difficulty"] = "carry" if out[-1]["solution"] >= 10 else "plain"
    return out


def table() -> pa.Table:
    return pa.Table.from_pylist(rows())


if __name__ == "__main__":
    pq.write_table(table(), OUT)
    print(f"wrote {ROWS} prompts to {OUT}")
