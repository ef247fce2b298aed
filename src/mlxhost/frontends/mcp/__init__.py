"""The configured MCP servers over HTTP (`/v1/mcp/*`): their state, their tools, one call (routes)."""
