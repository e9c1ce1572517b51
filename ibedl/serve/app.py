"""The app factory: ``create_app(settings)`` builds the FastAPI app; the model loads in the lifespan
(in a thread, so liveness answers at once and readiness says 503 until the adapter is ready)."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.routing import Mount, Route

from ibedl.serve import contract, docs_ui, oip
from ibedl.serve.errors import error_body, install_handlers
from ibedl.serve.middleware import RequestGuard
from ibedl.serve.routes import router
from ibedl.serve.settings import Settings
from ibedl.serve.state import Loader, ServiceState


def create_app(settings: Settings | None = None, loader: Loader | None = None) -> FastAPI:
    """Build the app. ``loader`` (default: the artifact of ``settings``) lets tests inject a predictor."""
    settings = settings or Settings()
    state = ServiceState(settings, loader)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(state.load(), name="load-model")
        try:
            yield
        finally:
            if not task.done():
                task.cancel()
            await state.shutdown()

    app = FastAPI(
        title="IB-EDL multiple-choice service",
        version="1.0",
        description="Answers multiple-choice questions with expected probabilities, Dirichlet belief masses, "
        "an uncertainty mass and an abstention decision.",
        lifespan=lifespan,
        docs_url=None,  # docs_ui serves /docs and /redoc with local assets
        redoc_url=None,
    )
    app.state.service = state
    install_handlers(app)
    routes: list = []  # every route, so that RequestGuard knows a request's before the router runs
    app.add_middleware(RequestGuard, state=state, routes=routes)
    app.include_router(router)
    app.include_router(oip.router)
    contract.install(app, state)
    docs_ui.install(app)
    # the included routers' own routes (FastAPI wraps included routers) and those added to the app itself
    routes.extend([*router.routes, *oip.router.routes, *(r for r in app.router.routes if isinstance(r, Route | Mount))])
    return app


__all__ = ["create_app", "ServiceState", "error_body"]
