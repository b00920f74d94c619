"""The ``pyengine`` command line: ``main.py`` dispatches ``generate`` (the batch tool,
``generate.py``), ``serve`` (``pyengine/server/cli.py``), ``core`` and ``simulate``.
Nothing here imports the web stack unless ``serve`` is the command."""
