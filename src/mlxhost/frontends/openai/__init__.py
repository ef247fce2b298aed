"""OpenAI's chat and text completions and model list: the dialect whose body is the one internal request."""
