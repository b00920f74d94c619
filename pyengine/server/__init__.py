"""The OpenAI-compatible HTTP server (``pyengine serve``): ``create_app(engine, args)``."""

from pyengine.server.app import create_app
from pyengine.server.args import ServerArgs

__all__ = ["create_app", "ServerArgs"]
