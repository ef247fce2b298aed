"""Rerank and score request bodies: Cohere's and Jina's `/v1/rerank` (one shape serves both) and vLLM's
`/v1/score`. Bounded here: at most MAX_DOCUMENTS documents or pairs per request."""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mlxhost.serving.schemas import refusing

MAX_DOCUMENTS = 1000  # Cohere's own limit per request
METHODS = ("cross_encoder", "yes_no", "embedding")
Method = Literal["cross_encoder", "yes_no", "embedding"]
# Qwen3-Reranker's default task line; `instruction` replaces it.
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


class _Body(BaseModel):
    # Clients of several services send their own extras (Jina's `task`, Cohere's `max_chunks_per_doc`):
    # accepted, unless they would change the ranking (refused below).
    model_config = ConfigDict(extra="allow")

    model: str
    # How to score (this server's extension); None: the model decides (rerank/methods.py).
    method: Optional[Method] = None
    instruction: Optional[str] = None  # the task line of a yes/no reranker's prompt


class RerankRequest(_Body):
    query: str
    documents: Annotated[list[Union[str, dict]], Field(min_length=1, max_length=MAX_DOCUMENTS)]
    top_n: Optional[Annotated[int, Field(ge=1)]] = None
    return_documents: bool = True
    max_tokens_per_doc: Optional[Annotated[int, Field(ge=1)]] = None  # Cohere v2: longer documents are cut
    rank_fields: Annotated[Optional[list[str]], refusing("rank_fields: only the `text` field is ranked",
                                                         (None, ["text"]))] = None

    @field_validator("query")
    @classmethod
    def _query(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("query is empty")
        return v

    def texts(self) -> list[str]:
        """Each document's text; a ValueError names the first one without any."""
        out = []
        for i, d in enumerate(self.documents):
            text = d if isinstance(d, str) else d.get("text")
            if not isinstance(text, str):
                raise ValueError(f"documents[{i}] has no `text` string")
            if not text.strip():
                raise ValueError(f"documents[{i}] is empty")
            out.append(text)
        return out


class ScoreRequest(_Body):
    """vLLM's: `text_1` against each of `text_2` (one to many), or pairwise when both are lists."""

    text_1: Union[str, list[str]]
    text_2: Union[str, list[str]]
    truncate_prompt_tokens: Annotated[Optional[int], refusing("texts are never truncated here")] = None

    def pairs(self) -> list[tuple[str, str]]:
        a = [self.text_1] if isinstance(self.text_1, str) else list(self.text_1)
        b = [self.text_2] if isinstance(self.text_2, str) else list(self.text_2)
        if len(a) == 1:
            a = a * len(b)
        if not a or not b or len(a) != len(b):
            raise ValueError("text_1 must be one text or as many texts as text_2 (pairwise)")
        if len(b) > MAX_DOCUMENTS:
            raise ValueError(f"{len(b)} pairs; at most {MAX_DOCUMENTS} per request")
        for name, texts in (("text_1", a), ("text_2", b)):
            for i, t in enumerate(texts):
                if not t.strip():
                    raise ValueError(f"{name}[{i}] is empty")
        return list(zip(a, b))
