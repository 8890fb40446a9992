"""Local document search: a small BM25 index and the `search` / `open` tools over it.

BM25 is Okapi BM25 with the Lucene idf, `log(1 + (N - df + 0.5) / (df + 0.5))`, which is never
negative (the original Robertson idf goes negative for terms in over half the documents and would
rank a document lower for matching them). A document's title is indexed as part of its text.
Tokens are lowercase runs of letters and digits; there is no stemming or stop-word list, which is
enough for a corpus of names and short facts.
"""

import math
import re
from collections import Counter
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from agent_grpo.tools.tool import Tool, tool

__all__ = ["BM25Index", "Document", "make_search_tools", "tokenize"]

_TOKEN = re.compile(r"[a-z0-9]+")


class Document(BaseModel):
    """One searchable document."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    id: str
    """Stable id the `open` tool takes, e.g. `p017`."""
    title: str
    """Short title shown in search results."""
    text: str
    """Full text returned by `open`."""


def tokenize(text: str) -> list[str]:
    """Lowercase alphanumeric tokens of `text`."""
    return _TOKEN.findall(text.lower())


class BM25Index:
    """An in-memory Okapi BM25 index over a fixed list of documents."""

    def __init__(self, documents: Sequence[Document], k1: float = 1.5, b: float = 0.75) -> None:
        self.documents = list(documents)
        self.by_id = {doc.id: doc for doc in self.documents}
        if len(self.by_id) != len(self.documents):
            raise ValueError("document ids must be unique")
        self.k1, self.b = k1, b
        self._tf = [Counter(tokenize(f"{d.title} {d.text}")) for d in self.documents]
        lengths = [sum(tf.values()) for tf in self._tf]
        self._length = lengths
        self._avg_length = sum(lengths) / max(len(lengths), 1)
        df = Counter(term for tf in self._tf for term in tf)
        n = len(self.documents)
        self._idf = {t: math.log(1 + (n - f + 0.5) / (f + 0.5)) for t, f in df.items()}

    def score(self, query: str, index: int) -> float:
        """BM25 score of document `index` for `query` (repeated query terms count once each)."""
        tf, length = self._tf[index], self._length[index]
        norm = self.k1 * (1 - self.b + self.b * length / self._avg_length)
        total = 0.0
        for term in tokenize(query):
            freq = tf.get(term, 0)
            if freq:
                total += self._idf[term] * freq * (self.k1 + 1) / (freq + norm)
        return total

    def search(self, query: str, k: int = 3) -> list[tuple[Document, float]]:
        """The `k` best documents with a positive score, best first, ties in corpus order."""
        scored = [(self.score(query, i), i) for i in range(len(self.documents))]
        ranked = sorted((s for s in scored if s[0] > 0), key=lambda s: (-s[0], s[1]))
        return [(self.documents[i], score) for score, i in ranked[:k]]


def make_search_tools(index: BM25Index, k: int = 3) -> list[Tool]:
    """The `search` tool (ids and titles of the top `k` hits) and `open` (a document's text)."""

    @tool
    def search(query: str) -> str:
        """Search the documents; returns the id and title of the best matches."""
        hits = index.search(query, k)
        if not hits:
            return "No results."
        return "\n".join(f"{doc.id}: {doc.title}" for doc, _ in hits)

    @tool(name="open")
    def open_document(id: str) -> str:
        """Open a document by its id (as shown by search) and return its text."""
        doc = index.by_id.get(id.strip())
        if doc is None:
            raise ValueError(f"no document with id {id!r}; use an id from the search results")
        return doc.text

    return [search, open_document]
