"""Tools from Model Context Protocol servers, run by this server for any client: `config` (the
`--mcp-config` file and the limits), `client` (one connection per server in its own task, restarted
when it dies; the manager of them all), `remote` (the checks on a URL a request names), `loop` (the
tool-call loop every dialect runs: model round, calls, results back, until the model answers).
Imports no MLX and nothing of frontends/: a dialect hands the loop a function that runs one model round."""
