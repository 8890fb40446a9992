"""Make the shipped word problems,
`agent_grpo/envs/data/arithmetic_word_problems-{train,test}.jsonl`.

    python scripts/make_word_problems.py            # rewrites the shipped files
    python scripts/make_word_problems.py --out DIR  # writes them somewhere else

Each row has `question` (the story), `answer` (an integer) and `expression` (the
arithmetic behind it, for readers; the environment does not use it). Numbers are large enough that
a small model gets them wrong in its head and right with the calculator. `random.Random` sequences
are stable across Python versions, so a run rebuilds the shipped files byte for byte (a test checks
it). The two splits share templates but never a question.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

SEED = 0
"""Seed the shipped files were made from."""
TRAIN_ROWS = 300
"""Problems in the train split."""
TEST_ROWS = 100
"""Problems in the test split (the held-out one)."""
DATA_DIR = Path(__file__).resolve().parents[1] / "envs" / "data"
"""Where the shipped files live."""

_NAMES = ["Mia", "Omar", "Lena", "Ravi", "Ana", "Tom", "Yuki", "Sam", "Ines", "Kofi", "Noor", "Eli"]
_ITEMS = ["apples", "stamps", "marbles", "bolts", "beads", "cards", "shells", "tiles", "coins"]
_BOXES = ["boxes", "crates", "bags", "jars", "trays"]

Problem = tuple[str, str, int]
"""(question, expression, answer)."""
Row = dict[str, str | int]
"""One line of the file: question, answer, expression."""


def _restock(r: random.Random) -> Problem:
    name, item, box = r.choice(_NAMES), r.choice(_ITEMS), r.choice(_BOXES)
    have, boxes, per = r.randint(100, 999), r.randint(12, 99), r.randint(12, 99)
    question = (f"{name} has {have} {item}. {name} buys {boxes} {box} with {per} {item} in each. "
                f"How many {item} does {name} have now?")  # fmt: skip
    return question, f"{have} + {boxes} * {per}", have + boxes * per


def _sell(r: random.Random) -> Problem:
    name, item = r.choice(_NAMES), r.choice(_ITEMS)
    days, per = r.randint(12, 60), r.randint(15, 99)
    have = days * per + r.randint(100, 999)
    question = (f"A shop has {have} {item}. {name} sells {per} {item} every day for {days} days. "
                f"How many {item} are left?")  # fmt: skip
    return question, f"{have} - {days} * {per}", have - days * per


def _share(r: random.Random) -> Problem:
    name, item, box = r.choice(_NAMES), r.choice(_ITEMS), r.choice(_BOXES)
    boxes, each = r.randint(12, 96), r.randint(23, 250)
    question = (f"{name} packs {boxes * each} {item} into {boxes} {box}, the same number in each. "
                f"How many {item} go in each of the {box}?")  # fmt: skip
    return question, f"{boxes * each} / {boxes}", each


def _tickets(r: random.Random) -> Problem:
    adults, children = r.randint(20, 400), r.randint(20, 400)
    adult_price, child_price = r.randint(11, 95), r.randint(5, 40)
    question = (f"A museum sold {adults} adult tickets at {adult_price} dollars each and "
                f"{children} child tickets at {child_price} dollars each. "
                f"How many dollars did it take in?")  # fmt: skip
    total = adults * adult_price + children * child_price
    return question, f"{adults} * {adult_price} + {children} * {child_price}", total


def _rows(r: random.Random) -> Problem:
    name = r.choice(_NAMES)
    rows, seats, empty = r.randint(15, 80), r.randint(12, 60), r.randint(10, 200)
    question = (f"A hall has {rows} rows of {seats} seats. At {name}'s concert {empty} seats "
                f"stay empty. How many seats are taken?")  # fmt: skip
    return question, f"{rows} * {seats} - {empty}", rows * seats - empty


TEMPLATES: list[Callable[[random.Random], Problem]] = [_restock, _sell, _share, _tickets, _rows]
"""One function per kind of story."""


def make_problems(seed: int = SEED, n: int = TRAIN_ROWS + TEST_ROWS) -> list[Row]:
    """`n` distinct problems (no question twice), templates in turn, numbers drawn from `seed`."""
    r, seen, rows = random.Random(seed), set[str](), list[Row]()
    while len(rows) < n:
        question, expression, answer = TEMPLATES[len(rows) % len(TEMPLATES)](r)
        if question not in seen:
            seen.add(question)
            rows.append({"question": question, "answer": answer, "expression": expression})
    return rows


def to_jsonl(rows: list[Row]) -> str:
    """One JSON object a line, keys in a fixed order."""
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def write_splits(out: Path, seed: int = SEED) -> list[Path]:
    """Write the train and test files into `out`; returns their paths."""
    rows = make_problems(seed)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, part in (("train", rows[:TRAIN_ROWS]), ("test", rows[TRAIN_ROWS:])):
        path = out / f"arithmetic_word_problems-{split}.jsonl"
        path.write_text(to_jsonl(part))
        paths.append(path)
    return paths


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DATA_DIR, help="folder to write the files to")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    for path in write_splits(args.out, args.seed):
        print(path)
