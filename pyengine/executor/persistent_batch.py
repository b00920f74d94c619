"""The executor's persistent batch: state kept per row across steps.

A row is an entry of the batch (``0 <= row < max_num_seqs``, see docs/contract.md). For each
row the executor keeps its block table, its sampling (or pooling) parameters, the token
history penalties need, and the last token it sampled (on the device, to fill the
plan's placeholders). A plan changes this state only through its ``freed_rows``,
``new_*`` and ``block_table_*`` arrays, applied before the step runs.
"""

from __future__ import annotations

from typing import Optional, Union

import numpy as np
import torch

from pyengine.errors import StepResultError
from pyengine.executor.logits_pipeline import LogitsPipeline
from pyengine.executor.penalties import TokenHistory, history_entries
from pyengine.executor.plan import StepPlanLike
from pyengine.executor.row_isolation import INERT_PARAMS
from pyengine.executor.sampling_table import SamplingTable
from pyengine.sampling_params import PoolingParams, SamplingParams

RequestParams = Union[SamplingParams, PoolingParams]


class PlanStateError(StepResultError, ValueError):
    """A plan refers to something the executor was not told about (e.g. unknown seq id)."""


class PersistentBatch:
    """Row-indexed state: on the device, block tables, the last sampled token and the
    sampling parameters; on the host, which sequence holds each row."""

    def __init__(
        self,
        max_rows: int,
        max_blocks_per_seq: int,
        vocab_size: int,
        device: torch.device,
        logits_pipeline: Optional[LogitsPipeline] = None,
        num_tables: int = 1,
    ) -> None:
        self.max_rows = max_rows
        self.vocab_size = vocab_size
        self.device = device
        # Every row's block table in each of a hybrid model's per-group tables
        # (``kv_tables.py``; one table otherwise); ``block_table`` is table 0's (a view).
        self.block_tables = torch.zeros(num_tables, max_rows, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.block_table = self.block_tables[0]
        self.last_sampled = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.sampling = SamplingTable(max_rows, device)
        # The logits processors' per-request state (None on tensor-parallel ranks > 0).
        self.logits_pipeline = logits_pipeline
        self.pooling: dict[int, PoolingParams] = {}
        # Row -> sequence id, so a step's results name their sequences (-1: never held).
        self.seq_ids = np.full(max_rows, -1, dtype=np.int64)
        self.row_errors: dict[int, str] = {}
        self.history: Optional[TokenHistory] = None

    def apply_plan(self, plan: StepPlanLike) -> None:
        """Release freed rows, install new sequences (with the parameters that came in the
        plan), write block-table changes."""
        if self.pooling and len(plan.freed_rows):  # pooling rows are rare: skip the loop otherwise
            for row in plan.freed_rows.tolist():
                self.pooling.pop(row, None)
        if self.logits_pipeline is not None and len(plan.freed_rows):
            self.logits_pipeline.free(plan.freed_rows)
        if len(plan.new_rows):
            self._install_new_rows(plan)
        self.write_block_tables(plan)

    def write_block_tables(self, plan: StepPlanLike) -> None:
        """The plan's block-table writes, each into its table (``block_table_groups``; a
        plan without it writes table 0): one indexed store, with no host sync (the
        tensor-parallel workers, which keep no other row state, call this alone)."""
        if not len(plan.block_table_rows):
            return
        to_device = lambda array: torch.from_numpy(array.astype(np.int64)).to(self.device)  # noqa: E731
        rows, cols = to_device(plan.block_table_rows), to_device(plan.block_table_cols)
        ids = torch.from_numpy(plan.block_table_ids.astype(np.int32)).to(self.device)
        groups = getattr(plan, "block_table_groups", None)
        if groups is None or not len(groups):
            self.block_table[rows, cols] = ids
        else:
            self.block_tables[to_device(groups), rows, cols] = ids

    def _install_new_rows(self, plan: StepPlanLike) -> None:
        rows = plan.new_rows.astype(np.int64)
        request_params: list[RequestParams] = list(plan.new_params)
        for seq_id, p in zip(plan.new_seq_ids.tolist(), request_params):
            if not isinstance(p, (SamplingParams, PoolingParams)):
                raise PlanStateError(f"plan {plan.step_id}: no parameters given for new sequence {seq_id}")
        self.seq_ids[rows] = plan.new_seq_ids.astype(np.int64)
        is_sampling = np.array([isinstance(p, SamplingParams) for p in request_params], dtype=bool)
        sampling_rows = rows[is_sampling]
        installed = self._install_sampling(sampling_rows, [p for p in request_params if isinstance(p, SamplingParams)])
        self.sampling.install_non_sampling(rows[~is_sampling])
        if self.logits_pipeline is not None and len(sampling_rows):
            _install_processors(self.logits_pipeline, plan, np.flatnonzero(is_sampling), installed)
        for row, p in zip(rows.tolist(), request_params):
            if isinstance(p, PoolingParams):
                self.pooling[row] = p
            else:
                self.pooling.pop(row, None)
        self._install_history(plan, rows)

    def _install_sampling(self, rows: np.ndarray, params: list[SamplingParams]) -> list[SamplingParams]:
        """Installs the rows' parameters; if that fails, row by row, and a row whose own
        parameters fail gets inert ones and is reported (``take_row_errors``). Returns
        the parameters each row got."""
        try:
            self.sampling.install(rows, params)
            return params
        except Exception:  # noqa: BLE001 - isolated below
            pass
        installed = list(params)
        for k, (row, p) in enumerate(zip(rows.tolist(), params)):
            one = np.array([row], dtype=np.int64)
            try:
                self.sampling.install(one, [p])
            except Exception as error:  # noqa: BLE001 - the row's request gets the error
                self.row_errors[int(self.seq_ids[row])] = f"its sampling parameters could not be installed: {error!r}"
                self.sampling.install(one, [INERT_PARAMS])
                installed[k] = INERT_PARAMS
        return installed

    def take_row_errors(self) -> Optional[dict[int, str]]:
        """Sequences whose own per-row work failed since the last call, with the error
        (None when none did: nothing is allocated on the ordinary step)."""
        if not self.row_errors:
            return None
        errors, self.row_errors = self.row_errors, {}
        return errors

    def _install_history(self, plan: StepPlanLike, rows: np.ndarray) -> None:
        if self.history is None:
            if not self.sampling.uses_penalties[rows].any():
                return
            self.history = TokenHistory(self.max_rows, self.vocab_size, self.device)
        row_index = torch.from_numpy(rows).to(self.device)
        self.history.reset_rows(row_index)
        token_rows, tokens, is_prompt = history_entries(
            rows, plan.new_token_offsets, plan.new_token_ids, plan.new_num_prompt_tokens
        )
        to_device = lambda array: torch.from_numpy(np.ascontiguousarray(array)).to(self.device)  # noqa: E731
        self.history.add_prompt_tokens(to_device(token_rows[is_prompt]), to_device(tokens[is_prompt]))
        self.history.add_output_tokens(to_device(token_rows[~is_prompt]), to_device(tokens[~is_prompt]))

    def record_sampled(self, rows: torch.Tensor, token_ids: torch.Tensor, host_token_ids: np.ndarray) -> None:
        """Remember this step's samples (placeholders of the next plan; penalty history;
        the logits processors' state)."""
        self.last_sampled[rows] = token_ids
        if self.history is not None:
            self.history.add_output_tokens(rows, token_ids)
        if self.logits_pipeline is not None:
            self.logits_pipeline.record_sampled(token_ids, host_token_ids)


def _install_processors(
    pipeline: LogitsPipeline, plan: StepPlanLike, entries: np.ndarray, params: list[SamplingParams]
) -> None:
    """Tells the logits processors about new sampling sequences (``entries``: their
    positions among the plan's new sequences), with their outputs so far and, when a
    custom processor is installed, their prompt (the built-in ones never read it: no
    per-request list of the prompt otherwise)."""
    offsets, ids = plan.new_token_offsets, plan.new_token_ids
    for k, p in zip(entries.tolist(), params):
        start, split = int(offsets[k]), int(offsets[k]) + int(plan.new_num_prompt_tokens[k])
        prompt = ids[start:split].tolist() if pipeline.custom else None
        pipeline.install(int(plan.new_rows[k]), p, prompt, ids[split : offsets[k + 1]].tolist())
