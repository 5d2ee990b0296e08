"""sdfarm's HTTP gateway: the OpenAI images API, a jobs API with server-sent progress events,
bearer tokens, limits and Prometheus metrics, over a farm's Redis (`sdfarm gateway`)."""

from sdfarm.gateway.app import APIError, create_app
from sdfarm.gateway.cli import main

__all__ = ["APIError", "create_app", "main"]
