"""The Search-v0 corpus: facts about fictional people, towns and companies, made from a seed.

Names are built from syllables, so no model can know the facts: it has to look them up. The corpus
is shipped as `agent_grpo/envs/data/search_corpus.json` and rebuilt byte for byte by

    python -m agent_grpo.envs.search_corpus

(a test checks the shipped file equals a rebuild). The generator uses `random.Random`, whose
`choice`/`shuffle`/`randint` sequences are stable across Python versions.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from functools import cache
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from agent_grpo.tools.search import Document

__all__ = ["Company", "Corpus", "Person", "Town", "build_corpus", "load_corpus"]

CORPUS_PATH = Path(__file__).parent / "data" / "search_corpus.json"
"""Where the shipped corpus lives."""
CORPUS_SEED = 0
"""Seed the shipped corpus was built from."""

_ONSETS = ["b", "br", "d", "dr", "f", "g", "k", "kr", "l", "m", "n", "p", "r", "s", "t", "v", "z"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou"]
_CODAS = ["", "", "l", "n", "r", "s", "th", "sk", "nd"]
_TOWN_SUFFIX = ["mere", "holt", "wick", "ford", "by", "stead"]
_COMPANY_SUFFIX = ["Works", "Guild", "Company", "Foundry", "Traders"]
_PROFESSIONS = [
    "baker", "cartographer", "glassblower", "weaver", "clockmaker", "potter", "beekeeper",
    "shipwright", "tailor", "brewer", "librarian", "stonemason",
]  # fmt: skip
_PRODUCTS = [
    "copper kettles", "rope", "lanterns", "wool blankets", "ink", "bicycles", "violins",
    "barrels", "paper kites", "candles", "sundials", "tin whistles", "umbrellas", "saddles",
]  # fmt: skip
_FEATURES = ["stone bridge", "spring fair", "old mill", "clock tower", "salt market", "orchards"]
_HOBBIES = ["chess", "rowing", "birdwatching", "painting", "fishing", "singing", "archery"]


class _Entity(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class Town(_Entity):
    """A fictional town."""

    id: str
    """Document id, `t000`..."""
    name: str
    """Unique name."""
    river: str
    """The river it lies on."""
    founded: int
    """Year it was founded."""
    feature: str
    """What it is known for (a distractor fact)."""


class Company(_Entity):
    """A fictional company."""

    id: str
    """Document id, `c000`..."""
    name: str
    """Unique name."""
    product: str
    """What it makes."""
    founded: int
    """Year it was founded."""
    town: str
    """Name of the town of its headquarters."""


class Person(_Entity):
    """A fictional person."""

    id: str
    """Document id, `p000`..."""
    name: str
    """Unique full name."""
    profession: str
    """What they do."""
    town: str
    """Name of the town they were born in."""
    company: str
    """Name of the company they work for."""
    hobby: str
    """A distractor fact."""


class Corpus(_Entity):
    """The whole world: entities and the documents rendered from them."""

    seed: int
    """Seed it was built from."""
    towns: list[Town]
    """All towns."""
    companies: list[Company]
    """All companies."""
    people: list[Person]
    """All people."""
    documents: list[Document]
    """One document per entity, in the order towns, companies, people."""


def _word(rng: random.Random, syllables: int) -> str:
    parts = [rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables)]
    return ("".join(parts) + rng.choice(_CODAS)).capitalize()


def _unique(
    rng: random.Random, n: int, make: Callable[[random.Random], str], taken: set[str]
) -> list[str]:
    names: list[str] = []
    while len(names) < n:
        name = make(rng)
        if name not in taken:
            taken.add(name)
            names.append(name)
    return names


def _town_doc(t: Town) -> Document:
    text = (
        f"{t.name} is a town on the river {t.river}, founded in {t.founded}. "
        f"It is known for its {t.feature}."
    )
    return Document(id=t.id, title=t.name, text=text)


def _company_doc(c: Company) -> Document:
    text = (
        f"{c.name} makes {c.product}. It was founded in {c.founded} and has its "
        f"headquarters in {c.town}."
    )
    return Document(id=c.id, title=c.name, text=text)


def _person_doc(p: Person) -> Document:
    first = p.name.split()[0]
    text = (
        f"{p.name} is a {p.profession} who was born in {p.town}. {first} works for "
        f"{p.company} and enjoys {p.hobby}."
    )
    return Document(id=p.id, title=p.name, text=text)


def build_corpus(
    seed: int = CORPUS_SEED, n_towns: int = 40, n_companies: int = 30, n_people: int = 300
) -> Corpus:
    """Build the world deterministically from `seed`."""
    rng = random.Random(seed)
    taken: set[str] = set()
    rivers = _unique(rng, 12, lambda r: _word(r, 2), taken)
    town_names = _unique(
        rng, n_towns, lambda r: _word(r, 1).lower() + r.choice(_TOWN_SUFFIX), taken
    )
    towns = [
        Town(
            id=f"t{i:03d}",
            name=name.capitalize(),
            river=rng.choice(rivers),
            founded=rng.randint(1200, 1899),
            feature=rng.choice(_FEATURES),
        )
        for i, name in enumerate(town_names)
    ]
    stems = _unique(rng, n_companies, lambda r: _word(r, 2), taken)
    companies = [
        Company(
            id=f"c{i:03d}",
            name=f"{stem} {rng.choice(_COMPANY_SUFFIX)}",
            product=rng.choice(_PRODUCTS),
            founded=rng.randint(1750, 1999),
            town=rng.choice(towns).name,
        )
        for i, stem in enumerate(stems)
    ]
    first_names = _unique(rng, 40, lambda r: _word(r, 2), taken)
    surnames = _unique(rng, n_people, lambda r: _word(r, 2) + r.choice(["ett", "er", "ow"]), taken)
    people = [
        Person(
            id=f"p{i:03d}",
            name=f"{rng.choice(first_names)} {surname}",
            profession=rng.choice(_PROFESSIONS),
            town=rng.choice(towns).name,
            company=rng.choice(companies).name,
            hobby=rng.choice(_HOBBIES),
        )
        for i, surname in enumerate(surnames)
    ]
    documents = (
        [_town_doc(t) for t in towns]
        + [_company_doc(c) for c in companies]
        + [_person_doc(p) for p in people]
    )
    return Corpus(seed=seed, towns=towns, companies=companies, people=people, documents=documents)


def dump_corpus(corpus: Corpus) -> str:
    """The shipped file's exact text for `corpus`."""
    return json.dumps(corpus.model_dump(), indent=1, sort_keys=True) + "\n"


@cache
def load_corpus(path: Path = CORPUS_PATH) -> Corpus:
    """Load (once per process) the shipped corpus."""
    return Corpus.model_validate_json(path.read_text())


if __name__ == "__main__":
    CORPUS_PATH.parent.mkdir(parents=True, exist_ok=True)
    CORPUS_PATH.write_text(dump_corpus(build_corpus()))
    print(f"wrote {CORPUS_PATH}")
