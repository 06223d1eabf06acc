"""`forerun serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn)."""

from forerun.server.app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]
