"""The HTTP transport: FastAPI app factory, routes, HTTP-only schemas, error statuses, middlewares."""
