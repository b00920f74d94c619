"""OpenAI's Responses API (``/v1/responses``): ``protocol.py`` the bodies,
``unsupported.py`` what is refused by name, ``conversation.py`` input items -> chat
messages, ``prepare.py`` the chat endpoint's steps, ``output.py`` the response object,
``events.py`` the stream, ``store.py`` the bounded store, ``api.py`` the routes (imported by
``app.py``, not here: ``context.py`` needs the store without the routes). See
``docs/responses_api.md``."""
