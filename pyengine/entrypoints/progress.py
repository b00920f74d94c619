"""Progress of one ``LLM`` batch, as the waiting caller reports it.

``LLM.generate`` / ``chat`` / ``embed`` refresh a progress object a few times a second
with what finished since the last call (``(index in the batch, output)`` pairs) and how many tokens the engine has generated for
the batch so far. Two kinds:

- :class:`RequestBar` (``use_tqdm=True``, vLLM's bar): finished requests out of all, with
  the output rate, refreshed as tokens come (not only when a request ends);
- :class:`TokenProgress` (``pyengine generate``): generated tokens out of the batch's token
  budget (each request's ``max_tokens`` times ``n``, capped by what its prompt leaves of
  ``max_model_len``); a request that ends early gives back its unused budget, so the bar
  ends at 100%.

Either writes a tqdm bar when its stream is a terminal, and otherwise one plain line every
``log_interval_s`` seconds and one at the end: a log file gets a few lines, not a bar
redrawn five times a second.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Optional, Protocol, TextIO

#: Seconds between progress lines when the stream is not a terminal.
LOG_INTERVAL_S = 10.0


class Progress(Protocol):
    """What ``LLM`` drives: ``start`` once (prompt lengths, parameters, the model's length),
    ``update`` a few times a second, ``close`` once (also when the batch fails)."""

    def start(self, prompt_lens: list[int], params: list[Any], max_model_len: int) -> None: ...

    def update(self, finished: list[tuple[int, Any]], generated_tokens: int) -> None: ...

    def close(self) -> None: ...


def _is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (ValueError, OSError):  # a closed stream
        return False


class _Display:
    """A tqdm bar on a terminal, periodic plain lines elsewhere."""

    def __init__(self, desc: str, unit: str, stream: Optional[TextIO], log_interval_s: float,
                 bar_factory: Optional[Callable[..., Any]] = None) -> None:
        self.desc, self.unit = desc, unit
        self.stream = stream if stream is not None else sys.stderr
        self.log_interval_s = log_interval_s
        self.bar: Any = None
        self.started = time.perf_counter()
        self.last_line = self.started
        if bar_factory is not None or _is_terminal(self.stream):
            if bar_factory is None:
                from tqdm.auto import tqdm as bar_factory
            self.bar = bar_factory(total=0, desc=desc, unit=unit, dynamic_ncols=True, file=self.stream)

    def show(self, n: int, total: int, postfix: str, final: bool = False) -> None:
        if self.bar is not None:
            self.bar.total, self.bar.n = total, n
            self.bar.set_postfix_str(postfix, refresh=True)
            return
        now = time.perf_counter()
        if final or now - self.last_line >= self.log_interval_s:
            self.last_line = now
            share = f" ({n / total:.0%})" if total else ""
            print(f"{self.desc}: {n:,}/{total:,} {self.unit}{share}, {postfix}, {now - self.started:.1f} s",
                  file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def rate(self, tokens: int) -> str:
        return f"{tokens / max(1e-9, time.perf_counter() - self.started):,.0f} tok/s out"


class RequestBar:
    """Finished requests out of the batch (vLLM's bar); ``bar_factory`` is a tqdm-like class
    (vLLM's ``use_tqdm=<callable>``)."""

    def __init__(self, desc: str, stream: Optional[TextIO] = None, log_interval_s: float = LOG_INTERVAL_S,
                 bar_factory: Optional[Callable[..., Any]] = None) -> None:
        self.display = _Display(desc, "req", stream, log_interval_s, bar_factory)
        self.total = self.done = self.tokens = 0

    def start(self, prompt_lens: list[int], params: list[Any], max_model_len: int) -> None:
        self.total = len(params)
        self.display.show(0, self.total, self.display.rate(0))

    def update(self, finished: list[Any], generated_tokens: int) -> None:
        self.done += len(finished)
        self.tokens = generated_tokens
        self.display.show(self.done, self.total, self.display.rate(generated_tokens))

    def close(self) -> None:
        self.display.show(self.done, self.total, self.display.rate(self.tokens), final=True)
        self.display.close()


class TokenProgress:
    """Generated tokens out of the batch's token budget (see the module docstring)."""

    def __init__(self, desc: str = "generate", stream: Optional[TextIO] = None,
                 log_interval_s: float = LOG_INTERVAL_S) -> None:
        self.display = _Display(desc, "tok", stream, log_interval_s)
        self.budgets: list[int] = []
        self.total = self.released = self.tokens = self.done = self.requests = 0

    def start(self, prompt_lens: list[int], params: list[Any], max_model_len: int) -> None:
        self.requests = len(params)
        self.budgets = [_budget(p, length, max_model_len) for p, length in zip(params, prompt_lens)]
        self.total = sum(self.budgets)
        self._show()

    def update(self, finished: list[Any], generated_tokens: int) -> None:
        for index, output in finished:
            budget = self.budgets[index]
            produced = sum(len(c.token_ids) for c in getattr(output, "outputs", ()) or ())
            self.released += max(0, budget - produced)
            self.done += 1
        self.tokens = generated_tokens
        self._show()

    def _show(self, final: bool = False) -> None:
        n = min(self.total, self.tokens + self.released)
        self.display.show(n, self.total, f"{self.done}/{self.requests} req, {self.display.rate(self.tokens)}",
                          final=final)

    def close(self) -> None:
        self._show(final=True)
        self.display.close()


def _budget(params: Any, prompt_len: int, max_model_len: int) -> int:
    """Tokens a request may generate in all: ``max_tokens`` (or all the room) times ``n``."""
    room = max(1, max_model_len - prompt_len)
    max_tokens = getattr(params, "max_tokens", 1)  # a pooling request: one step
    return min(room, max_tokens if max_tokens is not None else room) * int(getattr(params, "n", 1) or 1)
