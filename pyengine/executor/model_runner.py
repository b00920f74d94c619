"""The ModelRunner: executes one step plan (docs/contract.md) and returns sampled tokens.

Flow of :meth:`ModelRunner.execute`: apply the plan's row changes to the persistent batch
-> build input tensors (placeholders filled from ``last_sampled`` on the device) -> model
forward over the paged KV cache -> logits of ``logits_indices`` only (then, for rows that
asked for prompt logprobs, their prompt positions' in bounded slices) -> grammar masks of
constrained samples -> sampler -> remember the samples -> pool the embedding sequences.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch

from pyengine.errors import InvalidConfigError
from pyengine.executor.attention.metadata import StepAttentionLayout
from pyengine.executor.attention.selector import (
    AttentionBackendChoice,
    resolve_block_size,
    select_attention_backend,
    select_latent_attention_backend,
)
from pyengine.executor.attention.tables import TableAttentionBackend
from pyengine.executor.config import ExecutorConfig
from pyengine.executor.draft_proposer import DraftProposer
from pyengine.executor.eagle3_proposer import Eagle3Proposer
from pyengine.executor.grammar_mask import GrammarMaskApplier
from pyengine.executor.kv_cache import KVCacheShape, PagedKVCache
from pyengine.executor.kv_tables import KVTables, model_kv_tables
from pyengine.executor.latent_kv_cache import LatentKVCache, LatentKVCacheShape
from pyengine.executor.logits_pipeline import LogitsPipeline
from pyengine.executor.masked_rows import fail_fully_masked
from pyengine.executor.memory_profile import decide_num_blocks
from pyengine.executor.persistent_batch import PersistentBatch, PlanStateError
from pyengine.executor.plan import StepPlanLike
from pyengine.executor.pooling import pool_hidden_states
from pyengine.executor.prompt_logprobs import (
    SLICE_POSITIONS,
    PromptLogprobsJob,
    PromptLogprobsTable,
    compute_prompt_logprobs,
)
from pyengine.executor.proposals import StepTokens
from pyengine.executor.rejection_sampler import DraftLayout, Verdict
from pyengine.executor.row_isolation import mask_isolated, process_isolated, sample_isolated
from pyengine.executor.runner_output import ModelRunnerOutput, PromptLogprobsOutput
from pyengine.executor.sampler import Sampler
from pyengine.executor.spec_verify import SpecVerifier, draft_layout, process_entries
from pyengine.logits_processors.loading import resolve_processor
from pyengine.models.config import DecoderConfig
from pyengine.models.layer_config import kv_groups as layer_kv_groups
from pyengine.models.loader import LoadedModel, load_model
from pyengine.models.parallel import CollectiveError, ParallelContext
from pyengine.models.vocab_parallel import whole_embedding

logger = logging.getLogger(__name__)

_NO_SAMPLES = np.zeros(0, dtype=np.int64)


class ModelRunner:
    """Owns the model, the KV cache, the persistent batch and the sampler (one device)."""

    def __init__(self, loaded: LoadedModel, config: ExecutorConfig) -> None:
        config = resolve_block_size(config)  # block_size=None: this platform's default
        self.config = config
        self.loaded = loaded
        self.model = loaded.model
        self.model.pack_for_cpu()  # oneDNN-packed matmul weights on CPU float32; no-op elsewhere
        self.device = loaded.device
        model_config = loaded.config
        self.max_model_len = _max_model_len(config, model_config.max_position_embeddings)
        self.block_size = config.block_size
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.attention_backend: Union[AttentionBackendChoice, TableAttentionBackend]
        self.kv_shape: Union[KVCacheShape, LatentKVCacheShape]
        # A hybrid model's per-group block tables (None: one table shared by every layer),
        # whatever the engine's configuration: the same on every tensor-parallel rank, and
        # a proposer's layers read these tables (``kv_tables.py``).
        self.kv_tables = model_kv_tables(model_config)
        if model_config.mla is not None:  # DeepSeek: one latent row per token, its own attention
            self.attention_backend = select_latent_attention_backend(config.attention_backend)
            self.kv_shape = LatentKVCacheShape(
                num_layers=model_config.num_hidden_layers,
                latent_dim=model_config.mla.latent_dim,
                value_dim=model_config.mla.kv_lora_rank,
                block_size=self.block_size,
                dtype=loaded.dtype,
            )
        else:
            backend = select_attention_backend(config.attention_backend, self.device, loaded.dtype)
            tables = self.kv_tables
            self.attention_backend = backend if tables is None else TableAttentionBackend(backend, tables.table_of_layer)
            self.kv_shape = KVCacheShape(
                num_layers=model_config.num_hidden_layers if tables is None else tables.layers_per_table,
                num_kv_heads=self.model.num_kv_heads,
                head_dim=model_config.head_dim,
                block_size=self.block_size,
                dtype=loaded.dtype,
            )
        # speculative_config's draft model or EAGLE-3 head, on tensor-parallel rank 0 only:
        # loaded before the cache is sized, which pays for its cache too.
        proposer = self._load_proposer(loaded, config)
        num_blocks = decide_num_blocks(
            config,
            self.kv_shape,
            self.device,
            config.max_num_seqs * self.max_blocks_per_seq * self.num_kv_tables,
            self._profile_forward,
            None if proposer is None else proposer.cache_size,
        )
        num_blocks = self.model.parallel.min_over_ranks(num_blocks)  # every rank must hold them
        self.kv_cache = new_kv_cache(self.kv_shape, num_blocks, self.device, self.kv_tables)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB), attention backend %s",
            num_blocks,
            self.block_size,
            self.kv_cache.num_bytes / 2**20,
            self.attention_backend.name,
        )
        # Sampling, and so the logits processors, happen once: on tensor-parallel rank 0.
        pipeline = None
        if self.model.parallel.rank == 0:
            custom = [resolve_processor(spec) for spec in config.logits_processors]
            pipeline = LogitsPipeline.build(config, self.device, loaded.eos_token_ids, custom)
        self.batch = PersistentBatch(
            config.max_num_seqs,
            self.max_blocks_per_seq,
            model_config.vocab_size,
            self.device,
            pipeline,
            self.num_kv_tables,
        )
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.sampler = Sampler(self.batch.sampling, self.generator)
        self.verifier = SpecVerifier(self.batch.sampling, self.generator)
        self.prompt_logprobs = PromptLogprobsTable(config.max_num_seqs, model_config.vocab_size)
        self.proposer: Optional[Union[DraftProposer, Eagle3Proposer]] = proposer
        self.eagle3: Optional[Eagle3Proposer] = proposer if isinstance(proposer, Eagle3Proposer) else None
        if proposer is not None:
            proposer.allocate(num_blocks)  # its cache mirrors the target's block ids
        self.grammar_masks = GrammarMaskApplier(self.device)

    @classmethod
    def from_pretrained(
        cls, path: Union[str, Path], config: Optional[ExecutorConfig] = None, parallel: Optional[ParallelContext] = None
    ) -> "ModelRunner":
        """Load the checkpoint folder ``path`` (or dummy weights) and build a runner
        (``parallel``: this process's tensor-parallel rank; it loads only its shard)."""
        config = config if config is not None else ExecutorConfig()
        loaded = load_model(
            path, dtype=config.dtype, device=config.device, load_format=config.load_format, seed=config.seed,
            parallel=parallel, quantization=config.quantization,
        )
        return cls(loaded, config)

    def _load_proposer(
        self, loaded: LoadedModel, config: ExecutorConfig
    ) -> Optional[Union[DraftProposer, Eagle3Proposer]]:
        """The draft model or EAGLE-3 head (None without one, and on tensor-parallel ranks
        other than 0: drafts are proposed once, on rank 0, and reach the other ranks in the
        next step's plan). Neither is split: a draft model is loaded whole (vLLM's
        ``draft_tensor_parallel_size=1``); an EAGLE-3 head reads the target's auxiliary
        hidden states, whole on every rank after the all-reduces, and, sharing the target's
        embedding at size > 1, the whole matrix gathered here from every rank's slice (a
        collective: every rank takes part)."""
        spec = config.speculative_config
        if spec is None or not spec.proposed_by_executor:
            return None
        parallel = self.model.parallel
        whole = None
        if spec.method == "eagle3" and parallel.world_size > 1:
            whole = whole_embedding(self.model.embed_tokens)
        if parallel.rank != 0:
            return None
        if spec.method == "draft_model":
            return DraftProposer.load(spec, loaded, config, self.block_size, self.max_model_len, self.kv_tables)
        return Eagle3Proposer.load(spec, loaded, config, self.block_size, self.max_model_len, whole)

    @property
    def kv_groups(self) -> list[tuple[Optional[int], int]]:
        """The layers reading this runner's block tables, grouped by attention need, for the
        scheduler (``layer_config.kv_groups``): the model's, and with one shared table a
        proposer's (a full-attention draft keeps a windowed target's blocks). With
        per-group tables only the model's, which the tables are laid out from: a
        proposer's layers read those tables (``kv_tables.proposer_tables``)."""
        groups = model_kv_groups(self.loaded.config)
        if self.proposer is not None and self.kv_tables is None:
            groups += self.proposer.kv_groups
        return groups

    @property
    def group_tables(self) -> bool:
        """Whether the cache is laid out for per-group block tables (a hybrid model): the
        scheduler is asked to keep them (``SchedulerConfig(group_tables=...)``)."""
        return self.kv_tables is not None

    @property
    def num_kv_tables(self) -> int:
        return 1 if self.kv_tables is None else self.kv_tables.num_tables

    @property
    def num_kv_blocks(self) -> int:
        """Blocks in the KV cache (what the scheduler's block pool must be sized to)."""
        return self.kv_cache.num_blocks

    @torch.inference_mode()
    def execute(
        self,
        plan: StepPlanLike,
        *,
        return_logits: bool = False,
        return_hidden: bool = False,
    ) -> ModelRunnerOutput:
        """Run one plan (the parameters of its new sequences come in ``plan.new_params``)."""
        if self.batch.row_errors:
            self.batch.take_row_errors()  # a failed step's leftovers are not this step's
        prompt_job = self.prompt_logprobs.job(plan)  # every plan: it follows the rows' changes
        self.batch.apply_plan(plan)
        num_tokens = len(plan.input_ids)
        if num_tokens == 0:
            return ModelRunnerOutput(plan.step_id, np.zeros(0, dtype=np.int64), row_errors=self.batch.take_row_errors())
        device = self.device
        rows = _to_device(plan.rows, torch.int64, device)
        input_ids = self._input_ids(plan, rows)
        positions = _to_device(plan.positions, torch.int64, device)
        layout = self._layout(plan, rows)
        logits_indices_t = _to_device(plan.logits_indices, torch.int64, device)
        aux = None
        if self.eagle3 is not None and self.eagle3.begin_step(plan):  # the target's states, same forward
            hidden, logits, aux = self._forward_capturing(input_ids, positions, layout, logits_indices_t)
        else:
            hidden, logits = self._forward(input_ids, positions, layout, logits_indices_t)
        output = ModelRunnerOutput(
            plan.step_id, np.zeros(0, dtype=np.int64), hidden_states=hidden if return_hidden else None
        )
        if prompt_job is not None:  # rare: kept out of the sampled rows' path
            output.prompt_logprobs = self._prompt_logprobs(prompt_job, hidden)
        drafts = draft_layout(plan) if len(plan.logits_indices) else None
        if drafts is not None:  # speculative decoding: verify every sequence's drafts
            self._verify(plan, drafts, logits, positions[logits_indices_t] + 1, output)
            output.logits = logits if return_logits else None
        elif len(plan.logits_indices):
            if self.batch.logits_pipeline is not None:
                logits = process_isolated(
                    self.batch.logits_pipeline, logits, plan.sample_rows, self._greedy_only(plan.sample_rows),
                    lambda i, error: self._row_failed(int(plan.sample_rows[i]), f"a logits processor failed: {error!r}"),
                )
            if plan.grammar_mask is not None:  # structured outputs: computed while the forward ran
                mask_isolated(
                    self.grammar_masks, plan, logits,
                    lambda i, error: self._row_failed(int(plan.sample_rows[i]), f"its grammar mask failed: {error!r}"),
                )
            self._fail_fully_masked(plan, logits)
            sample_rows = _to_device(plan.sample_rows, torch.int64, device)
            result = sample_isolated(
                self.sampler, logits, plan.sample_rows, positions[logits_indices_t] + 1, self.batch.history,
                lambda i, error: self._row_failed(int(plan.sample_rows[i]), f"sampling failed: {error!r}"),
            )
            output.sampled_token_ids = result.token_ids.cpu().numpy()
            self.batch.record_sampled(sample_rows, result.token_ids, output.sampled_token_ids)
            output.logprobs = result.logprobs
            if result.logprobs is not None:
                output.sampled_seq_ids = self.batch.seq_ids[plan.sample_rows]
            output.logits = logits if return_logits else None
        if self.proposer is not None:  # the draft model or EAGLE-3 head: next step's drafts
            step = StepTokens(plan, input_ids, positions, layout, aux)
            output.next_drafts = self.proposer.after_step(step, output, self.batch)
        if len(plan.pool_indices):
            output.pooled = self._pool(plan, hidden)
            output.pooled_seq_ids = self.batch.seq_ids[plan.rows[plan.pool_indices]]
        output.row_errors = self.batch.take_row_errors()
        return output

    def _verify(
        self, plan: StepPlanLike, layout: DraftLayout, logits: torch.Tensor, next_positions: torch.Tensor,
        output: ModelRunnerOutput,
    ) -> None:
        """Verifies the plan's drafts (``spec_verify``) and fills ``output``: per sequence its
        kept drafts and one more token (``sampled_token_ids``), ``num_accepted``, logprobs
        one row per emitted token."""
        entry_rows = np.asarray(plan.sample_rows)
        seq_rows = entry_rows[layout.starts]
        pipeline = self.batch.logits_pipeline
        on_failure = lambda i, error: self._row_failed(int(entry_rows[i]), f"verifying drafts failed: {error!r}")  # noqa: E731
        no_drafts = None
        if pipeline is not None:
            logits = process_entries(pipeline, logits, layout, seq_rows, self._greedy_only(seq_rows), on_failure)
            no_drafts = pipeline.follows_output(seq_rows)
        if plan.grammar_mask is not None:
            mask_isolated(self.grammar_masks, plan, logits, on_failure)
        self._fail_fully_masked(plan, logits)
        history = self.batch.history
        verification = self.verifier.verify_isolated(logits, layout, entry_rows, next_positions, history, no_drafts,
                                                     on_failure)
        verdict = verification.verdict
        output.sampled_token_ids = verdict.token_ids
        output.num_accepted = verdict.num_accepted
        output.logprobs = self.verifier.logprobs(verification, entry_rows)
        token_rows = entry_rows[verdict.token_entries]
        if output.logprobs is not None:
            output.sampled_seq_ids = self.batch.seq_ids[token_rows]
        self._record_runs(seq_rows, token_rows, verdict)

    def _record_runs(self, seq_rows: np.ndarray, token_rows: np.ndarray, verdict: Verdict) -> None:
        """Remembers a speculative step's tokens: each row's last one (the next plan's
        placeholder), all of them in the penalty history and the processors' outputs."""
        device = self.device
        ends = np.cumsum(verdict.num_accepted.astype(np.int64) + 1)
        last = torch.from_numpy(verdict.token_ids[ends - 1]).to(device)
        self.batch.last_sampled[_to_device(seq_rows, torch.int64, device)] = last
        if self.batch.history is not None:
            self.batch.history.add_output_tokens(_to_device(token_rows, torch.int64, device),
                                                 _to_device(verdict.token_ids, torch.int64, device))
        if self.batch.logits_pipeline is not None:
            runs = np.split(verdict.token_ids, ends[:-1])
            self.batch.logits_pipeline.record_runs(last, [run.tolist() for run in runs])

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, layout: StepAttentionLayout,
        logits_indices: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states of every token and float32 logits of ``logits_indices`` (the
        tensor-parallel rank 0 runs this with its collectives, see ``tensor_parallel``)."""
        hidden = self.model(
            input_ids, positions, self.attention_backend.bind(self.kv_cache, layout), context_lens(self.model, layout)
        )
        return hidden, self._logits_at(hidden, logits_indices)

    def _forward_capturing(
        self, input_ids: torch.Tensor, positions: torch.Tensor, layout: StepAttentionLayout,
        logits_indices: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``_forward``, plus the residual stream entering each of ``aux_layers`` [T, n * hidden]
        (the tensor-parallel rank 0 runs it with its collectives, see ``tensor_parallel``)."""
        assert self.eagle3 is not None  # only EAGLE-3 captures
        hidden, aux = self.model.forward_capturing(
            input_ids, positions, self.attention_backend.bind(self.kv_cache, layout),
            context_lens(self.model, layout), self.eagle3.aux_layers,
        )
        assert aux is not None  # aux_layers is not empty
        return hidden, self._logits_at(hidden, logits_indices), aux

    def _logits_at(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """float32 logits of the rows ``logits_indices`` of ``hidden`` (none: an empty [0, vocab])."""
        if logits_indices.numel() == 0:
            return hidden.new_zeros(0, self.model.config.vocab_size, dtype=torch.float32)
        return self.model.compute_logits(hidden.index_select(0, logits_indices))

    def _fail_fully_masked(self, plan: StepPlanLike, logits: torch.Tensor) -> None:
        """Fails the samples left with no token (see ``masked_rows``), only those."""
        pipeline = self.batch.logits_pipeline
        samples = pipeline.maskable_samples(plan.sample_rows) if pipeline is not None else _NO_SAMPLES
        if plan.grammar_mask is not None:
            samples = np.union1d(samples, plan.mask_sample_indices.astype(np.int64))
        fail_fully_masked(logits, samples, lambda i, message: self._row_failed(int(plan.sample_rows[i]), message))

    def _greedy_only(self, rows: np.ndarray) -> bool:
        """Every row of the step decodes greedily and none wants logprobs (argmax-invariant
        logits processors cannot change its tokens then)."""
        table = self.batch.sampling
        return bool(table.greedy[rows].all()) and not bool((table.logprobs[rows] >= 0).any())

    def _prompt_logprobs(self, job: PromptLogprobsJob, hidden: torch.Tensor) -> Optional[PromptLogprobsOutput]:
        """The job's prompt log-probabilities, a slice of positions at a time; if computing
        them fails (memory), only the sequences that asked fail."""
        try:
            return compute_prompt_logprobs(job, lambda indices: self._prompt_logits(hidden, indices), self.batch.seq_ids)
        except CollectiveError:
            raise  # a peer is gone: not this request's failure
        except Exception as error:  # noqa: BLE001 - those rows' requests get the error
            self._prompt_logits_abandoned(error)
            for row in job.rows.tolist():
                self._row_failed(row, f"computing prompt logprobs failed: {error!r}")
            return None

    def _prompt_logits(self, hidden: torch.Tensor, token_indices: np.ndarray) -> torch.Tensor:
        """Float32 logits of the step's tokens ``token_indices`` (one slice of prompt positions)."""
        return self.model.compute_logits(hidden.index_select(0, _to_device(token_indices, torch.int64, self.device)))

    def _prompt_logits_abandoned(self, error: BaseException) -> None:
        """The step's remaining prompt slices will not be computed (tensor parallelism:
        the collectives the workers still wait in)."""
        return None

    def _row_failed(self, row: int, message: str) -> None:
        self.batch.row_errors[int(self.batch.seq_ids[row])] = message

    def _input_ids(self, plan: StepPlanLike, rows: torch.Tensor) -> torch.Tensor:
        placeholders = np.flatnonzero(plan.input_ids < 0)
        if placeholders.size == len(plan.input_ids) == len(plan.rows):
            # A decode step planned behind the previous one (pipeline depth 2): every row's
            # one token is the one it last sampled, read in one gather.
            return self.batch.last_sampled.index_select(0, rows)
        input_ids = _to_device(plan.input_ids, torch.int64, self.device)
        if placeholders.size:
            owners = np.searchsorted(plan.query_start_loc, placeholders, side="right") - 1
            owner_rows = rows[torch.from_numpy(owners).to(self.device)]
            input_ids[torch.from_numpy(placeholders).to(self.device)] = self.batch.last_sampled[owner_rows]
        return input_ids

    def _layout(self, plan: StepPlanLike, rows: torch.Tensor) -> StepAttentionLayout:
        width = -(-int(plan.seq_lens.max()) // self.block_size)
        group_layouts: tuple[StepAttentionLayout, ...] = ()
        if self.kv_tables is not None:
            extra = self.kv_tables.num_tables - 1
            if len(plan.group_slot_mapping) != extra * len(plan.slot_mapping):
                raise PlanStateError(
                    f"plan {plan.step_id}: the cache has {extra + 1} per-group block tables but the plan's "
                    f"group_slot_mapping has {len(plan.group_slot_mapping)} slots for {len(plan.slot_mapping)} "
                    "tokens (a hand-built plan needs HandPlanner(tables=runner.num_kv_tables))"
                )
            slots = _to_device(plan.group_slot_mapping, torch.int64, self.device).view(-1, extra)
            group_layouts = tuple(
                StepAttentionLayout(
                    query_start_loc=plan.query_start_loc,
                    seq_lens=plan.seq_lens,
                    num_scheduled_tokens=plan.num_scheduled_tokens,
                    slot_mapping=slots[:, t - 1].contiguous(),
                    block_tables=self.batch.block_tables[t, :, :width].index_select(0, rows),
                    block_size=self.block_size,
                )
                for t in range(1, extra + 1)
            )
        return StepAttentionLayout(
            query_start_loc=plan.query_start_loc,
            seq_lens=plan.seq_lens,
            num_scheduled_tokens=plan.num_scheduled_tokens,
            slot_mapping=_to_device(plan.slot_mapping, torch.int64, self.device),
            block_tables=self.batch.block_table[:, :width].index_select(0, rows),
            block_size=self.block_size,
            group_layouts=group_layouts,
        )

    def _pool(self, plan: StepPlanLike, hidden: torch.Tensor) -> torch.Tensor:
        indices = plan.pool_indices.astype(np.int64)
        starts = plan.query_start_loc[indices].astype(np.int64)
        ends = plan.query_start_loc[indices + 1].astype(np.int64)
        pool_params = [self.batch.pooling[int(row)] for row in plan.rows[indices]]
        return pool_hidden_states(hidden, starts, ends, pool_params)

    @torch.inference_mode()
    def _profile_forward(self) -> None:
        """Run the largest step (one prefill of max_num_batched_tokens) on a scratch cache;
        with the SDPA backends also the chunks after cached context that make each form's
        temporaries the largest (``profile_steps``: after one slice of context)."""
        tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        backend = self.attention_backend
        extra_steps = getattr(backend, "profile_steps", None)  # the SDPA backends (a hybrid model's wrapped too)
        if extra_steps is not None:
            for chunk, context, bound in extra_steps(tokens, self.max_model_len, self.loaded.config):
                self._profile_step(chunk, context, bound)  # its scratch cache and output dropped at once
        scratch, hidden = self._profile_step(tokens, 0, backend)
        sampled_rows = min(self.config.max_num_seqs, tokens)
        logits = self.model.compute_logits(hidden[:sampled_rows])
        torch.softmax(logits, dim=-1).sort(dim=-1)
        # One slice of prompt positions (prompt_logprobs), with the sampled logits alive.
        prompt = self.model.compute_logits(hidden[: min(SLICE_POSITIONS, tokens)])
        logprobs = torch.log_softmax(prompt, dim=-1)
        del prompt
        (logprobs > logprobs[:, :1]).sum(dim=-1)
        del scratch, hidden, logits, logprobs

    def _profile_step(
        self, tokens: int, context: int, backend: Union[AttentionBackendChoice, TableAttentionBackend]
    ) -> tuple[Union[PagedKVCache, LatentKVCache], torch.Tensor]:
        """One sequence's chunk of ``tokens`` after ``context`` cached rows (zeros) on a
        scratch cache, attended through ``backend``: the cache and the hidden states."""
        seq_len = context + tokens
        blocks = -(-seq_len // self.block_size)
        scratch = new_kv_cache(self.kv_shape, blocks, self.device, self.kv_tables)
        layout = StepAttentionLayout(
            query_start_loc=np.array([0, tokens], dtype=np.int64),
            seq_lens=np.array([seq_len], dtype=np.int64),
            num_scheduled_tokens=np.array([tokens], dtype=np.int64),
            slot_mapping=torch.arange(context, seq_len, device=self.device),
            block_tables=torch.arange(blocks, dtype=torch.int32, device=self.device)[None, :],
            block_size=self.block_size,
        )
        input_ids = torch.zeros(tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(context, seq_len, device=self.device)
        return scratch, self.model(input_ids, positions, backend.bind(scratch, layout))


def new_kv_cache(
    shape: Union[KVCacheShape, LatentKVCacheShape], num_blocks: int, device: torch.device,
    tables: Optional[KVTables] = None,
) -> Union[PagedKVCache, LatentKVCache]:
    """The cache a shape describes: K/V per head, or one latent row per token (MLA);
    ``tables``: a hybrid model's per-group tables, which say the cache tensor each layer
    uses (``kv_tables.py``)."""
    if isinstance(shape, LatentKVCacheShape):
        return LatentKVCache(shape, num_blocks, device)
    return PagedKVCache(shape, num_blocks, device, tables)


def _max_model_len(config: ExecutorConfig, max_positions: int) -> int:
    if config.max_model_len is None:
        return max_positions
    if config.max_model_len > max_positions:
        raise InvalidConfigError(
            f"max_model_len ({config.max_model_len}) exceeds the model's max_position_embeddings ({max_positions})"
        )
    return config.max_model_len


def context_lens(model: torch.nn.Module, layout: StepAttentionLayout) -> Optional[torch.Tensor]:
    """Each token's sequence length after the step, for a rotary that depends on it
    (longrope, ``models/rope.py``); None for every other model (no per-step cost)."""
    if not model.rotary.needs_context_lens:
        return None
    lengths = np.repeat(layout.seq_lens.astype(np.int64), layout.num_scheduled_tokens.astype(np.int64))
    return torch.from_numpy(lengths).to(layout.slot_mapping.device)


def _to_device(array: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device=device, dtype=dtype)


def model_kv_groups(model_config: DecoderConfig) -> list[tuple[Optional[int], int]]:
    """A model's KV groups by its per-layer windows (no window anywhere: one full group)."""
    return layer_kv_groups(model_config.layer_windows, model_config.num_hidden_layers)
