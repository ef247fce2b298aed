"""Exports of served model folders for other runtimes (`mlxhost export ...`).

Each exporter brings its own heavy dependencies (coremltools, torch) through an extra and imports them
only when it runs: the server never imports this package.
"""


class UnsupportedModelError(ValueError):
    """A model folder an exporter cannot handle; the message says why. Here, not in a module that imports
    torch, so the command line can catch it without the extra installed."""
