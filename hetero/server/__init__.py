"""`hetero serve`'s HTTP layer: OpenAI-compatible endpoints over the async engine."""
from hetero.server.app import ServerSettings, build_app

__all__ = ["ServerSettings", "build_app"]
