"""HTTP front doors, no MLX: common/ (the one gateway into the engines, SSE, errors, the gate, metrics)
and one folder per API dialect, each protocol + translate + render + routes. app.py puts them together."""
