"""``dsv4c serve``: an OpenAI-compatible HTTP server on the engine.

* :mod:`.protocol` checks OpenAI request bodies and shapes the responses;
* :mod:`.text` renders chat templates and turns generated tokens into text, cut at stop strings;
* :mod:`.chat` is the conversation protocol of chat requests: :mod:`.dsv4_encoding` and
  :mod:`.dsv41_encoding` (V4's and V4.1's prompt formats), :mod:`.dsml` (their two spellings of
  tool calls), :mod:`.chat_output` (reasoning, content and DSML tool calls parsed as they stream) and
  :mod:`.constrained` (llguidance token masks for forced tool calls and ``response_format``);
* :mod:`.engine_loop` owns the :class:`~dsv4c.runtime.engine.Engine` in one thread that runs
  continuous batching, and keeps the Prometheus metrics;
* :mod:`.app` is the FastAPI application; :mod:`.transport` the HTTP layer below it (body limits,
  server-sent events, the uvicorn server).
"""

from dsv4c.errors import UsageError

try:
    import fastapi  # noqa: F401
    import jinja2  # noqa: F401
    import prometheus_client  # noqa: F401
    import uvicorn  # noqa: F401
except ModuleNotFoundError as e:
    raise UsageError(f"`dsv4c serve` needs the {e.name} package: pip install 'dsv4c[serve]'") from None
