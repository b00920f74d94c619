"""The ways a caller drives the engine from Python: ``LLM`` (offline, vLLM's API),
``AsyncEngine`` (asyncio), and ``EngineClient``, the one interface the HTTP server talks
through (in-process here, multi-process in ``pyengine/multiprocess/``). ``progress`` is
what a waiting ``LLM`` caller sees. The public names are re-exported from ``pyengine``."""
