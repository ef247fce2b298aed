"""What every dialect shares: the one gateway into the engines (gateway), the one internal request
(schemas, serving, constraints, chat_output), SSE and heartbeats (sse), errors and the error-shape hook
each dialect registers (errors), the gate (security), metrics, and the prompt bound."""
