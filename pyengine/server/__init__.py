"""The OpenAI-compatible HTTP server (``pyengine serve``): ``create_app(engine, args)``.

``engine`` is an ``EngineClient`` (``pyengine.entrypoints.engine_client``; ``AsyncEngine`` in-process)
and the server uses nothing else of the engine: no module here imports ``pyengine.engine``
(``tests/test_server_boundary.py`` holds it to that), so the engine core can move to its
own process behind another client.

Module map (one concept each):

- ``cli``: ``pyengine serve`` flags (server options + ``EngineConfig`` fields), uvicorn.
- ``app``: the app factory; ``context``: the per-app ``ServerContext`` handlers share.
- ``args``: ``ServerArgs``; ``protocol``: pydantic request / response bodies.
- ``completions``, ``chat``, ``embeddings``: the ``/v1`` endpoints (chats render through
  ``pyengine.inputs.chat_template``, as ``LLM.chat`` does, template choice included);
  ``info``: ``/v1/models`` (+ ``/{id}``), ``/version``, ``/health`` / ``/ping``, ``/metrics``;
  ``tokenizer_api``: vLLM's ``/tokenize`` and ``/detokenize``.
- ``sampling``: request -> ``SamplingParams`` and token-id prompts, with 400s naming fields.
- ``engine_requests``: ``EngineRequests``, the engine requests of one HTTP request; client
  disconnects abort them.
- ``respond``: ``ResponseRun``, what completions and chat share: start, collect a whole response, or
  stream (usage chunk, ``[DONE]``, disconnects, errors as events).
- ``choices``: per-choice accumulation of deltas, usage, per-request metrics and log line.
- ``sse``: the streaming wire format; ``tokens``: token text / bytes for logprobs.
- ``errors``: OpenAI error bodies and exception handlers; ``guard``: API key middleware.
- ``health``: progress monitor and stall watchdog (thread dump); ``metrics``: Prometheus;
  ``logs``: structlog through a queue; ``stats_log``: periodic engine-stats lines.
- ``testing``: ``LiveServer``, the app on uvicorn in a thread (tests, benchmarks).
"""

from pyengine.server.app import create_app
from pyengine.server.args import ServerArgs

__all__ = ["create_app", "ServerArgs"]
