"""An MCP tool's credentials in a Responses request are the client's secret: the response object (returned,
stored, written to batch output) never carries them."""

from mlxhost.frontends.responses.protocol import ResponsesRequest
from mlxhost.frontends.responses.tools import served_tools
from mlxhost.frontends.responses.translate import envelope


def test_mcp_credentials_are_not_echoed():
    body = ResponsesRequest.model_validate({
        "model": "m", "input": "hi",
        "tools": [{"type": "mcp", "server_label": "remote", "server_url": "https://example.com/mcp",
                   "authorization": "Bearer sk-secret", "headers": {"X-Api-Key": "sk-other"}},
                  {"type": "function", "name": "f", "parameters": {"type": "object"}}]})
    echoed = envelope(body, served_tools(body.tools))
    assert "sk-secret" not in repr(echoed) and "sk-other" not in repr(echoed)
    mcp, function = echoed["tools"]
    assert mcp["server_label"] == "remote" and mcp["server_url"] == "https://example.com/mcp"
    assert function["name"] == "f"
