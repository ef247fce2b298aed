"""OpenAI's `/v1/embeddings`: the request body and route; the vectors come through the gateway."""
