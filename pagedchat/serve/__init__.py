"""`pagedchat serve`: the OpenAI-compatible HTTP API over one AsyncEngine (one loop thread, one KV pool)."""

from pagedchat.serve.app import ServeSettings, create_app
from pagedchat.serve.async_engine import AsyncEngine

__all__ = ["AsyncEngine", "ServeSettings", "create_app"]
