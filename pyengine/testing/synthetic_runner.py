"""A synthetic executor for the engine: no model, a fixed time per step.

``SleepRunner.execute`` sleeps for ``step_seconds`` (the GIL released, like a device
running a forward pass) and "samples" with :class:`FakeExecutor`, so the engine's
scheduling and output work is real while the executor's cost is known exactly. It
applies grammar masks (through :class:`FakeExecutor`), so with ``eos_token_ids`` it serves
constrained requests; without them the engine refuses constraints (no EOS).
:class:`ScriptedRunner` follows its script even under a grammar, as an executor that does
not mask: a scripted token the grammar refuses ends the request with ``dead_end``. Used by
``benches/overlap.py`` and by tests of the engine's threading.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from pyengine.devtools.fake_executor import FakeExecutor
from pyengine.executor.runner_output import ModelRunnerOutput


@dataclass(frozen=True)
class _Loaded:
    tokenizer: Any
    eos_token_ids: tuple[int, ...] = ()
    tokenizer_config: dict = field(default_factory=dict)


class SleepRunner:
    """Stands in for ``ModelRunner``: the attributes and ``execute`` the engine uses."""

    def __init__(
        self,
        step_seconds: float,
        num_kv_blocks: int = 65536,
        max_model_len: int = 4096,
        tokenizer_folder: Optional[Path] = None,
        max_rows: int = 4096,
        eos_token_ids: tuple[int, ...] = (),
        block_size: int = 16,
    ) -> None:
        from tokenizers import Tokenizer

        from pyengine.models.default_model import default_tiny_model

        folder = tokenizer_folder or default_tiny_model()
        tokenizer = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
        self.loaded = _Loaded(tokenizer, eos_token_ids)  # no EOS by default: every request runs to max_tokens
        self.step_seconds = step_seconds
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.fake = FakeExecutor(vocab=tokenizer.get_vocab_size(), max_rows=max_rows)

    def execute(self, plan: Any) -> ModelRunnerOutput:
        sampled = self.fake.run(plan)
        time.sleep(self.step_seconds)
        return ModelRunnerOutput(plan.step_id, sampled)


class ScriptedRunner(SleepRunner):
    """Every sequence "samples" the tokens of ``script`` in order (then repeats its last),
    so streaming, detokenization and stop strings can be tested on exact text."""

    def __init__(self, script: list[int], step_seconds: float = 0.0, **kwargs: Any) -> None:
        super().__init__(step_seconds, **kwargs)
        self.script = script
        self._prompt_len: dict[int, int] = {}

    def execute(self, plan: Any) -> ModelRunnerOutput:
        import numpy as np

        for row, n in zip(plan.new_rows.tolist(), plan.new_num_prompt_tokens.tolist()):
            self._prompt_len[row] = n
        out = []
        for idx, row in zip(plan.logits_indices.tolist(), plan.sample_rows.tolist()):
            k = int(plan.positions[idx]) + 1 - self._prompt_len[row]
            out.append(self.script[min(k, len(self.script) - 1)])
        if self.step_seconds:
            time.sleep(self.step_seconds)
        return ModelRunnerOutput(plan.step_id, np.array(out, dtype=np.int64))
