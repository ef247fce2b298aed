"""Exports of served model folders for other runtimes (`mlxserve export ...`).

Each exporter brings its own heavy dependencies (coremltools, torch) through an extra and imports them
only when it runs: the server never imports this package.
"""
