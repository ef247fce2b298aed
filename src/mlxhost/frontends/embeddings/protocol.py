"""OpenAI's `/v1/embeddings` request body; a misspelled field is a 400."""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import ConfigDict, Field

from mlxhost.serving.schemas import StrictModel

# OpenAI's own limit on inputs per request.
MAX_INPUTS = 2048


class EmbeddingRequest(StrictModel):
    model_config = ConfigDict(extra="forbid")  # a misspelled field is a 400, not silently ignored

    input: Union[str, list[str], list[int], list[list[int]]]
    model: str
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[Annotated[int, Field(ge=1)]] = None
    user: Optional[str] = None
