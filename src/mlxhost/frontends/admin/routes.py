"""Operating the server over HTTP: `/health`, `/version`, `/metrics` (Prometheus), `/v1/status` and the prefix cache's
`/v1/cache/stats` and `DELETE /v1/cache`, per model or for every model. Imports no MLX.

Reads answer from each engine's latest snapshot (engine/status.py), never by waiting for the engine thread:
a step that takes minutes must not hold a dashboard's poll. Only DELETE /v1/cache, which changes the cache,
is a call on the engine thread."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import Response

from mlxhost.frontends.common.metrics import Metrics


def add_admin_routes(app: FastAPI, models, metrics: Metrics) -> None:
    async def per_model(requested: str | None, fn) -> dict[str, object]:
        """`fn(core)` on each named (or every) model's engine thread; None for a model not loaded."""
        out = {}
        for name in names(requested):
            with models.hold(name) as engine:  # keeps it loaded until the call returns
                out[name] = await engine.call(fn) if engine is not None else None
        return out

    def snapshots(requested: str | None, read) -> dict[str, object]:
        """`read(snapshot)` of each named (or every) model's latest status snapshot; None for a model not loaded."""
        out = {}
        for name in names(requested):
            with models.hold(name) as engine:
                out[name] = read(engine.snapshot) if engine is not None else None
        return out

    def names(requested: str | None) -> list[str]:
        return [models.resolve(requested)] if requested is not None else models.names

    def one_or_all(requested: str | None, results: dict) -> dict:
        # One model (named, or the only one): its own answer, as a single-model server gives it.
        if requested is not None or len(results) == 1:
            (name, result), = results.items()
            return result if result is not None else not_loaded(name)
        return {"models": {name: r if r is not None else not_loaded(name) for name, r in results.items()}}

    def not_loaded(name: str) -> dict:
        return {"model": name, "status": models.state(name).value}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        from mlxhost import __version__  # the one place the version is kept (pyproject reads it too)

        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/status")
    async def status(model: str | None = None):
        out = one_or_all(model, snapshots(model, lambda snap: snap.status))
        batches = getattr(app.state, "batch_runner", None)  # the Batch API's progress (frontends/batch/), when on
        return {**out, "batches": batches.status()} if batches is not None else out

    @app.get("/v1/cache/stats")
    async def cache_stats(model: str | None = None):
        return one_or_all(model, snapshots(model, lambda snap: snap.cache_stats))

    @app.delete("/v1/cache")
    async def clear_cache(model: str | None = None):
        cleared = {name: n or 0 for name, n in (await per_model(model, lambda core: core.clear_cache())).items()}
        if model is not None or len(cleared) == 1:
            return {"cleared_blocks": sum(cleared.values())}
        return {"cleared_blocks": sum(cleared.values()), "models": cleared}
