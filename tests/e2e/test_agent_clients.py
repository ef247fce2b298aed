"""The ecosystem's agent clients end to end against the real server: LangChain's `ChatOpenAI` (`bind_tools`,
`with_structured_output`), an OpenAI Agents SDK agent with one function tool (Chat Completions model) and
LiteLLM's `completion` with the `openai/` prefix (whole, streamed, one tool call).

The tools' string arguments are bounded (`max_length`): a random-weight model picks a closing quote about
once in the vocabulary's size, so an unbounded string would run to max_tokens; a real model closes it."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Annotated

import agents
import langchain_openai

# LiteLLM reads these at import: its bundled model-cost map instead of a download, no other fetches.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_OFFLINE_MODE", "true")
import litellm  # noqa: E402
import pytest
from pydantic import BaseModel, Field


def get_weather(city: Annotated[str, Field(max_length=12)], unit: Annotated[str, Field(pattern="^[cf]$")]) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


class Card(BaseModel):
    name: str = Field(max_length=8)
    score: int = Field(ge=0, le=9)
    tags: list[Annotated[str, Field(max_length=5)]] = Field(max_length=2, default_factory=list)


@pytest.fixture(scope="module")
def llm(server):
    return langchain_openai.ChatOpenAI(base_url=server.base_url, api_key="x", model=server.model_name,
                                       temperature=1.0, max_tokens=120, max_retries=0, seed=1)


def test_langchain_bind_tools(llm):
    bound = llm.bind_tools([get_weather], tool_choice="required", parallel_tool_calls=False)
    msg = bound.invoke("What's the weather in Paris?")
    assert len(msg.tool_calls) == 1 and not msg.invalid_tool_calls
    call = msg.tool_calls[0]
    assert call["name"] == "get_weather" and len(call["args"]["city"]) <= 12 and call["args"]["unit"] in "cf"


def test_langchain_structured_output(llm):
    card = llm.with_structured_output(Card).invoke("Make a card")
    assert isinstance(card, Card) and 0 <= card.score <= 9


def test_agents_sdk_agent_calls_its_tool(server):
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)  # no traces leave the machine
    seen: list[str] = []

    @agents.function_tool
    def lookup(city: Annotated[str, Field(max_length=12)]) -> str:
        """Look up a city."""
        seen.append(city)
        return "found"

    client = AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    model = agents.OpenAIChatCompletionsModel(model=server.model_name, openai_client=client)
    # Required on the first turn; the SDK resets tool_choice after a tool ran, so the second turn answers.
    settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=60)
    agent = agents.Agent(name="helper", instructions="Use the lookup tool.", tools=[lookup], model=model,
                         model_settings=settings)
    result = asyncio.run(agents.Runner.run(agent, "Find Paris", max_turns=4))
    assert len(seen) == 1 and len(seen[0]) <= 12
    assert isinstance(result.final_output, str)


def _litellm_args(server) -> dict:
    # `openai/<served name>`: LiteLLM's generic OpenAI-compatible route, as its docs show for vLLM and others.
    return {"model": f"openai/{server.model_name}", "api_base": server.base_url, "api_key": "x", "num_retries": 0,
            "timeout": 120, "temperature": 1.0, "seed": 1}


def test_litellm_completion(server):
    response = litellm.completion(messages=[{"role": "user", "content": "Say hi"}], max_tokens=8,
                                  **_litellm_args(server))
    choice = response.choices[0]
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert response.usage.completion_tokens == 8 or choice.finish_reason == "stop"
    assert response.usage.prompt_tokens > 0


def test_litellm_streaming(server):
    chunks = list(litellm.completion(messages=[{"role": "user", "content": "Say hi"}], max_tokens=8, stream=True,
                                     **_litellm_args(server)))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) > 2 and text  # several deltas, not one whole reply
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    whole = litellm.stream_chunk_builder(chunks)
    assert whole.choices[0].message.content == text


def test_litellm_tool_call(server):
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "required": ["city", "unit"], "additionalProperties": False,
                       "properties": {"city": {"type": "string", "maxLength": 12},
                                      "unit": {"type": "string", "enum": ["c", "f"]}}}}}
    response = litellm.completion(messages=[{"role": "user", "content": "What's the weather in Paris?"}],
                                  tools=[tool], tool_choice="required", parallel_tool_calls=False, max_tokens=120,
                                  **_litellm_args(server))
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "tool_calls" and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and len(args["city"]) <= 12 and args["unit"] in "cf"
