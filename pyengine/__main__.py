"""``python -m pyengine ...``: the same command line as the ``pyengine`` console script
(``pyengine/cli/main.py``)."""

from pyengine.cli.main import run

if __name__ == "__main__":
    run()
