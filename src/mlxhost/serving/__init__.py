"""Request processing without HTTP: the served-model descriptor, the one internal request (schemas), prompt
preparation (templates, media, FIM, prompt bounds), output constraints and parsing, embedding jobs. Used by
frontends/ (HTTP), server/ and audio/; imports no MLX at import time."""
