"""Running the server over HTTP: health, metrics, status, the prefix cache, loading and unloading models
and LoRA adapters, the web page and the API docs."""
