"""The server: vLLM's OpenAI-compatible API over one engine, with metrics and a live page."""

from minipaged.serving.app import build_app
from minipaged.serving.server import header_timeout_protocol, serve

__all__ = ["build_app", "header_timeout_protocol", "serve"]
