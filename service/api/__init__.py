"""The HTTP layer: FastAPI app factory, routes, schemas, errors, middlewares and metrics."""

from service.api.app import create_app

__all__ = ["create_app"]
