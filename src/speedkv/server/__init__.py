"""An OpenAI-compatible HTTP server over the engine: `/v1/completions`, `/v1/chat/completions`
(streaming and not), `/v1/models`, `/metrics` and `/health`.

One scheduler thread owns the engine and runs every request in a continuous batch (each keeps
its own layer-asymmetric cache); HTTP handlers only validate, queue and relay tokens.

    app.py        routes                       schemas.py   request and response bodies
    prepare.py    body -> engine requests (tokens, method, sampling, limits)
    scheduler.py  the continuous-batching loop relay.py     queued job -> HTTP answer
    streaming.py  response bodies, SSE chunks  errors.py    the OpenAI error shape
    guards.py     API key, body size           metrics.py   Prometheus metrics
    config.py     server options               command.py   `speedkv serve`
"""

from speedkv.server.app import create_app
from speedkv.server.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]
