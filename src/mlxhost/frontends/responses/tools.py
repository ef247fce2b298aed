"""Responses `tools` and `tool_choice` as the chat request's function tools.

Function tools are served as they are; a `namespace` tool (a named group of functions, as Codex sends
its sub-agent tools) is flattened into its functions, and a call to one of them comes back with the
namespace it belongs to. Hosted tools (web_search, file_search, code_interpreter, mcp, ...) and custom
(free-form) tools cannot run here: they are skipped with a warning, unless `tool_choice` forces one,
which is a 400 (the reply could not be what the client asked for). Imports no MLX.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import ConfigDict, Discriminator, Field, Tag

from mlxhost.frontends.common.errors import APIError
from mlxhost.frontends.responses.render import ResponseRenderer
from mlxhost.serving.chat_output import OutputSpec
from mlxhost.serving.schemas import StrictModel

log = logging.getLogger(__name__)


class FunctionTool(StrictModel):
    # Newer hints (defer_loading, ...) are accepted: the model sees name, description and parameters.
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class OtherTool(StrictModel):
    """A hosted tool (web_search, file_search, code_interpreter, image_generation, computer_use_preview,
    local_shell, shell, apply_patch, mcp, ...) or a custom tool: kept to be echoed and named, not served."""

    model_config = ConfigDict(extra="allow")

    type: str
    name: Optional[str] = None

    @property
    def label(self) -> str:
        return f"{self.type} {self.name}" if self.name else self.type


class McpTool(StrictModel):
    """OpenAI's `mcp` tool: a configured server's label, or (with --mcp-allow-remote) a `server_url`;
    run by this server (responses/mcp.py), never given to the client to run."""

    model_config = ConfigDict(extra="allow")

    type: Literal["mcp"]
    server_label: Annotated[str, Field(min_length=1)]
    server_url: Optional[str] = None
    server_description: Optional[str] = None
    allowed_tools: Optional[Union[list[str], dict]] = None
    require_approval: Optional[Union[Literal["always", "never"], dict]] = None
    headers: Optional[dict[str, str]] = None
    authorization: Optional[str] = None

    @property
    def allowed(self) -> Optional[tuple[str, ...]]:
        tools = self.allowed_tools
        if isinstance(tools, dict):
            tools = tools.get("tool_names")
        return tuple(tools) if tools is not None else None


def _inner_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "function" if kind == "function" else "other"


InnerTool = Annotated[Union[Annotated[FunctionTool, Tag("function")], Annotated[OtherTool, Tag("other")]],
                      Discriminator(_inner_kind)]


class NamespaceTool(StrictModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["namespace"]
    name: Annotated[str, Field(min_length=1)]
    description: Optional[str] = None
    tools: list[InnerTool]


def _tool_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("function", "namespace", "mcp") else "other"


AnyTool = Annotated[Union[Annotated[FunctionTool, Tag("function")], Annotated[NamespaceTool, Tag("namespace")],
                          Annotated[McpTool, Tag("mcp")], Annotated[OtherTool, Tag("other")]],
                    Discriminator(_tool_kind)]


class FunctionChoice(StrictModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    name: str


class AllowedToolsChoice(StrictModel):
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[dict]


class OtherChoice(StrictModel):
    """Forces a hosted, custom or MCP tool: a 400 once translated."""

    model_config = ConfigDict(extra="allow")

    type: str
    name: Optional[str] = None


def _choice_kind(value: Any) -> str:
    if isinstance(value, str):
        return "mode"
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("function", "allowed_tools") else "other"


AnyChoice = Annotated[Union[Annotated[Literal["auto", "required", "none"], Tag("mode")],
                            Annotated[FunctionChoice, Tag("function")],
                            Annotated[AllowedToolsChoice, Tag("allowed_tools")],
                            Annotated[OtherChoice, Tag("other")]], Discriminator(_choice_kind)]


@dataclass
class ServedTools:
    """What the model is given: chat function specs, the namespace of each namespaced function, and
    the labels of the tools skipped."""

    functions: list[dict] = field(default_factory=list)
    namespaces: dict[str, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)

    def add(self, tool: FunctionTool, namespace: Optional[str] = None) -> None:
        if any(f["function"]["name"] == tool.name for f in self.functions):
            # Two functions of one name (in two namespaces): a call could not say which one it meant.
            self.skipped.append(f"{namespace}.{tool.name}" if namespace else tool.name)
            return
        spec = tool.model_dump(include={"name", "description", "parameters", "strict"}, exclude_none=True)
        self.functions.append({"type": "function", "function": spec})
        if namespace is not None:
            self.namespaces[tool.name] = namespace

    @property
    def names(self) -> set[str]:
        return {f["function"]["name"] for f in self.functions}


def served_tools(tools: Optional[list], run_mcp: bool = False) -> ServedTools:
    """`run_mcp`: `mcp` tools are run by this server (responses/mcp.py), so they are not skipped."""
    served = ServedTools()
    for tool in tools or ():
        if isinstance(tool, FunctionTool):
            served.add(tool)
        elif isinstance(tool, NamespaceTool):
            for inner in tool.tools:
                if isinstance(inner, FunctionTool):
                    served.add(inner, tool.name)
                else:
                    served.skipped.append(f"{tool.name}.{inner.name or inner.type}")
        elif isinstance(tool, McpTool):
            if not run_mcp:  # a server without MCP: skipped as other hosted tools are
                served.skipped.append(f"mcp {tool.server_label}")
        else:
            served.skipped.append(tool.label)
    if served.skipped:
        log.warning("/v1/responses: skipped %s: only function tools run on this server", ", ".join(served.skipped))
    return served


def chat_tool_choice(choice: Any, served: ServedTools) -> tuple[Any, list[dict]]:
    """The chat `tool_choice` and the functions it leaves the model (`allowed_tools` narrows them)."""
    functions = served.functions
    if isinstance(choice, OtherChoice):
        raise APIError(400, f"tool_choice forces the {choice.type} tool{f' {choice.name!r}' if choice.name else ''}, "
                       "which this server does not run: only function tools can be called", "tool_choice")
    if isinstance(choice, AllowedToolsChoice):
        allowed = {t.get("name") for t in choice.tools if t.get("type") == "function"}
        functions = [f for f in functions if f["function"]["name"] in allowed]
        choice = choice.mode
    if choice == "required" and not functions:
        raise APIError(400, "tool_choice requires a tool call, and no function tool is left to call"
                       + (f" (skipped: {', '.join(served.skipped)})" if served.skipped else ""), "tool_choice")
    if isinstance(choice, FunctionChoice):
        if choice.name not in served.names and choice.name in {s.rsplit(" ", 1)[-1] for s in served.skipped}:
            raise APIError(400, f"tool_choice forces the tool {choice.name!r}, which is not a function tool this "
                           "server can run", "tool_choice")
        choice = {"type": "function", "function": {"name": choice.name}}
    return choice, functions


class NamespacedRenderer(ResponseRenderer):
    """Function calls to a namespaced function carry their `namespace`, as clients route them by it."""

    def __init__(self, envelope: dict, spec: OutputSpec, namespaces: dict[str, str]) -> None:
        super().__init__(envelope, spec)
        self.namespaces = namespaces

    def _mark(self, item: Optional[dict]) -> None:
        if item and item.get("type") == "function_call" and item.get("name") in self.namespaces:
            item["namespace"] = self.namespaces[item["name"]]

    def feed(self, text: str, final: bool = False, incomplete: bool = False) -> list[dict]:
        events = super().feed(text, final, incomplete)
        if self.namespaces:
            for event in events:
                self._mark(event.get("item"))
            for item in self.items:
                self._mark(item)
        return events
