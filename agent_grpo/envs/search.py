"""Search-v0: two-hop questions about fictional people, answered with `search` and `open`.

"In what year was the town where Orlan Veskett was born founded?" needs two lookups: the person's
document names the town, the town's document has the year. The facts are invented
(`search_corpus.py`), so the model cannot answer from memory. Held-out tasks ask about people that
training tasks never mention (every fifth person), so evaluation measures searching, not recall.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from agent_grpo.envs.answers import text_verdict
from agent_grpo.envs.search_corpus import Company, Corpus, Person, Town, load_corpus
from agent_grpo.envs.text_env import ToolEnv, Verdict
from agent_grpo.tools.search import BM25Index, make_search_tools

__all__ = ["QUESTIONS", "SearchEnv", "SearchTask", "make_question"]

HELDOUT_EVERY = 5
"""Every fifth person is asked about only in held-out tasks."""

Hop = Literal["town", "company"]


class SearchTask(BaseModel):
    """One two-hop question."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    question: str
    """The question shown to the model."""
    answer: str
    """The expected answer."""
    person: str
    """The person the question starts from (first hop)."""
    bridge: str
    """The town or company the first hop leads to (second hop)."""


Fact = Callable[[Any], object]
QUESTIONS: dict[str, tuple[str, Hop, Fact]] = {
    "town_founded": (
        "In what year was the town where {person} was born founded?",
        "town",
        lambda t: t.founded,
    ),
    "town_river": (
        "Which river flows through the town where {person} was born?",
        "town",
        lambda t: t.river,
    ),
    "company_product": (
        "What does the company {person} works for make?",
        "company",
        lambda c: c.product,
    ),
    "company_founded": (
        "In what year was the company {person} works for founded?",
        "company",
        lambda c: c.founded,
    ),
    "company_town": (
        "In which town is the company {person} works for based?",
        "company",
        lambda c: c.town,
    ),
}
"""Question templates: text, which entity the first hop leads to, and the fact asked for."""


def make_question(corpus: Corpus, person: Person, kind: str) -> SearchTask:
    """The question of `kind` about `person`, with its answer."""
    template, hop, fact = QUESTIONS[kind]
    bridge: Town | Company
    if hop == "town":
        bridge = next(t for t in corpus.towns if t.name == person.town)
    else:
        bridge = next(c for c in corpus.companies if c.name == person.company)
    return SearchTask(
        question=template.format(person=person.name),
        answer=str(fact(bridge)),
        person=person.name,
        bridge=bridge.name,
    )


@cache
def _index() -> BM25Index:
    return BM25Index(load_corpus().documents)


def _hit_id(result: str, title: str) -> str:
    """The id of the search result titled `title` (else the first result's id)."""
    lines = [line.split(": ", 1) for line in result.splitlines() if ": " in line]
    return next((i for i, t in lines if t == title), lines[0][0] if lines else "")


class SearchEnv(ToolEnv[SearchTask]):
    """Answer a two-hop question about fictional people with the search and open tools."""

    reusable = True  # the corpus and index are read-only

    system_prompt = (
        "Answer the question. Use search to find documents and open to read one by id. "
        "When you know the answer, reply with: Answer: <answer>"
    )
    default_max_turns = 8

    def __init__(self, top_k: int = 3, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.corpus = load_corpus()
        self.tools = make_search_tools(_index(), k=top_k)

    def generate_task(self, rng: np.random.Generator) -> SearchTask:
        """A random question about a person of this split."""
        heldout = self.split == "heldout"
        people = [
            p for i, p in enumerate(self.corpus.people) if (i % HELDOUT_EVERY == 0) == heldout
        ]
        person = people[int(rng.integers(len(people)))]
        kind = sorted(QUESTIONS)[int(rng.integers(len(QUESTIONS)))]
        return make_question(self.corpus, person, kind)

    def user_prompt(self, task: SearchTask) -> str:
        """The question."""
        return task.question

    def verify(self, task: SearchTask, answer: str) -> Verdict:
        """Normalized word match of the `Answer:` line."""
        return text_verdict(answer, task.answer)

    def expert_action(self) -> str:
        """Search the person, open their page, search the bridge, open it, answer."""
        assert self.task is not None
        done = [c for c in self.tool_calls if c.error is None]
        targets = [self.task.person, self.task.bridge]
        if len(done) >= 2 * len(targets):
            return f"Answer: {self.task.answer}"
        target = targets[len(done) // 2]
        if len(done) % 2 == 0:
            return self.call("search", query=target)
        return self.call("open", id=_hit_id(done[-1].result or "", target))
