"""KV-cache events for prefix-aware routers (vLLM's ``--kv-events-config``):
``config.py`` the settings, ``wire.py`` the messages (vLLM's schema), ``publisher.py``
the ZMQ publisher thread. See ``docs/kv_events.md``."""
