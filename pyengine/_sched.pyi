"""Type stubs for ``pyengine._sched``, the native scheduler (Rust, PyO3).

The scheduler owns every sequence's scheduling state and the paged KV block pool. It
plans steps as flat numpy arrays (:class:`StepPlan`), takes back the sampled token ids,
and reports accepted tokens and finished sequences as :class:`OutputEvent`. See
``docs/contract.md`` for how the fields fit together.

A request's per-sample parameters ride into the plan that admits each sample
(``StepPlan.new_params``), and the executor's step result rides with its sampled ids
into that step's event (``OutputEvent.step_result``): the scheduler moves these objects
without reading them. Provided by the extension ``pyengine._native`` (``rust_sched/python``).
"""

from collections.abc import Sequence
from typing import Final, Literal, Optional, TypeAlias, final

import numpy as np
import numpy.typing as npt
from typing_extensions import Self

__all__ = [
    "CompiledConstraint",
    "FINISH_REASONS",
    "GrammarCompiler",
    "GrammarMaskTicket",
    "OutputEvent",
    "PLACEHOLDER_TOKEN",
    "Request",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerThread",
    "StepPlan",
    "THREAD_NAME",
    "__version__",
    "block_hashes",
]

__version__: Final[str]
#: Input token id meaning "the token this row sampled in the previous step".
PLACEHOLDER_TOKEN: Final[int]
#: Names of finish-reason codes, indexed by ``OutputEvent.finish_reasons``.
FINISH_REASONS: Final[tuple[str, str, str, str, str, str]]
#: OS-level name of the scheduler thread (``ps -T``, ``/proc/PID/task/*/comm``).
THREAD_NAME: Final[str]

_FinishReason: TypeAlias = Literal["stop", "length", "abort", "pooled", "error", "dead_end"]

@final
class SchedulerConfig:
    """The scheduler's engine arguments, validated on construction.

    Raises ``pyengine.InvalidConfigError`` (a ValueError) naming the argument at fault.
    """

    def __new__(
        cls,
        num_blocks: int,
        *,
        block_size: int = 16,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        max_model_len: int = 4096,
        long_prefill_token_threshold: int = 0,
        enable_prefix_caching: bool = True,
        enable_kv_events: bool = False,
        policy: Literal["fcfs", "priority"] = "fcfs",
        pipeline_depth: int = 2,
        num_speculative_tokens: int = 0,
        speculative_method: Literal["none", "ngram", "suffix", "executor"] = "none",
        prompt_lookup_min: int = 1,
        prompt_lookup_max: int = 3,
        spec_min_acceptance: float = 0.1,
        kv_groups: Sequence[tuple[Optional[int], int]] = ...,
        group_tables: bool = False,
    ) -> Self: ...
    @property
    def num_blocks(self) -> int:
        """KV blocks in the pool."""
    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
    @property
    def max_num_seqs(self) -> int:
        """Cap on running sequences; also the number of persistent-batch rows."""
    @property
    def max_num_batched_tokens(self) -> int:
        """Token budget of one step (decodes plus prefill chunks)."""
    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output)."""
    @property
    def long_prefill_token_threshold(self) -> int:
        """Cap on prefill tokens one sequence may take per step; 0 = budget only."""
    @property
    def enable_prefix_caching(self) -> bool: ...
    @property
    def enable_kv_events(self) -> bool:
        """Whether output events carry the prefix cache's changes (``kv_events``)."""
    @property
    def policy(self) -> Literal["fcfs", "priority"]:
        """``fcfs``: arrival order. ``priority``: lower value first, then arrival."""
    @property
    def pipeline_depth(self) -> int:
        """Steps planned ahead of their results: 1 or 2."""
    @property
    def num_speculative_tokens(self) -> int:
        """Drafts per sequence and step (k); 0 = speculation off."""
    @property
    def speculative_method(self) -> Literal["none", "ngram", "suffix", "executor"]:
        """``ngram`` / ``suffix``: proposed by the scheduler; ``executor``: with each result."""
    @property
    def prompt_lookup_min(self) -> int:
        """Shortest match the n-gram and suffix proposers look for."""
    @property
    def prompt_lookup_max(self) -> int:
        """Longest match the n-gram and suffix proposers look for."""
    @property
    def spec_min_acceptance(self) -> float:
        """Acceptance rate below which a sequence stops getting drafts (after a warm-up)."""
    @property
    def kv_groups(self) -> list[tuple[Optional[int], int]]:
        """The model's layers by attention need: ``(window, num_layers)``, window None for
        full attention. Empty: every layer sees the whole context."""
    @property
    def shared_window(self) -> Optional[int]:
        """With every group windowed, the widest window: blocks behind it are freed while a
        sequence runs. None (a full group, or no groups): every block is kept."""
    @property
    def group_tables(self) -> bool:
        """Whether a hybrid model's groups get block tables of their own (the executor
        asks for it when its cache is laid out per table)."""
    @property
    def table_layout(self) -> Optional[tuple[int, list[Optional[int]], list[int]]]:
        """With ``group_tables`` and a hybrid model (a full and a windowed group, split
        into at most 8 tables of at most ``layers_per_table`` layers): ``(layers_per_table, windows,
        groups)``, each table's window (None: full; full tables first) and the index of
        the group its layers come from (group ``g``'s layers, in order, fill its tables
        ``layers_per_table`` at a time). None: one table shared by every layer."""

@final
class Request:
    """What the scheduler needs to know about one request.

    ``n`` samples share the prompt's KV blocks; ``pooling`` requests are prefilled in one
    step and not sampled. Raises ``InvalidRequestError`` for malformed values; whether
    the request fits the engine is checked by ``add_request``.
    """

    def __new__(
        cls,
        request_id: str,
        prompt_token_ids: list[int],
        *,
        max_tokens: int = 16,
        min_tokens: int = 0,
        eos_token_ids: list[int] = ...,
        ignore_eos: bool = False,
        stop_token_ids: list[int] = ...,
        priority: int = 0,
        pooling: bool = False,
        n: int = 1,
        cache_salt: str | None = None,
        sample_params: list[object] | None = None,
        constraint: CompiledConstraint | None = None,
        no_spec: bool = False,
    ) -> Self:
        """``sample_params``: none, or one object per sample (its sampling or pooling
        parameters), handed to the executor in ``StepPlan.new_params``. ``constraint``:
        a compiled grammar every sample's output must match (each sample its own
        matcher). ``no_spec``: never propose drafts for it (the executor would refuse
        them: its logits processors follow its output), so it keeps the pipeline overlap."""
    @property
    def request_id(self) -> str: ...
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def n(self) -> int: ...
    @property
    def pooling(self) -> bool: ...
    @property
    def priority(self) -> int: ...
    @property
    def constrained(self) -> bool:
        """Whether a grammar constrains its output."""

@final
class StepPlan:
    """One step for the executor. ``R`` scheduled sequences, ``T`` tokens, ``S`` samples.

    Every array is a numpy array moved out of Rust without copying.
    """

    #: The attribute names, in contract order (tests check this stub, docs/contract.md
    #: and the Python plan classes against it).
    FIELDS: Final[list[str]]

    @property
    def step_id(self) -> int:
        """Increases by one per plan; results are submitted in this order."""
    @property
    def rows(self) -> npt.NDArray[np.int32]:
        """[R] persistent-batch row of each scheduled sequence."""
    @property
    def num_scheduled_tokens(self) -> npt.NDArray[np.int32]:
        """[R] tokens computed for each sequence in this step (1 for a decode)."""
    @property
    def query_start_loc(self) -> npt.NDArray[np.int32]:
        """[R+1] prefix sum of ``num_scheduled_tokens``, starting at 0."""
    @property
    def seq_lens(self) -> npt.NDArray[np.int32]:
        """[R] context length after this step (tokens before it + scheduled)."""
    @property
    def input_ids(self) -> npt.NDArray[np.int64]:
        """[T] token ids; ``PLACEHOLDER_TOKEN`` = the previous sample of this row."""
    @property
    def positions(self) -> npt.NDArray[np.int64]:
        """[T] position of each token in its sequence."""
    @property
    def slot_mapping(self) -> npt.NDArray[np.int64]:
        """[T] KV slot: ``block_id * block_size + position % block_size``."""
    @property
    def logits_indices(self) -> npt.NDArray[np.int64]:
        """[E] indices into the T tokens whose logits are sampled: one per entry (a sampled
        sequence with d drafts has 1 + d consecutive entries; E = S without drafts)."""
    @property
    def sample_rows(self) -> npt.NDArray[np.int32]:
        """[E] row of each entry's sequence, in ``logits_indices`` order."""
    @property
    def pool_indices(self) -> npt.NDArray[np.int32]:
        """[P] indices into ``rows`` of pooling sequences whose whole prompt is here."""
    @property
    def block_table_rows(self) -> npt.NDArray[np.int32]:
        """[B] block-table writes: ``block_table[rows[i], cols[i]] = ids[i]``."""
    @property
    def block_table_cols(self) -> npt.NDArray[np.int32]: ...
    @property
    def block_table_ids(self) -> npt.NDArray[np.int32]: ...
    @property
    def new_rows(self) -> npt.NDArray[np.int32]:
        """[K] rows of sequences entering (or re-entering) the batch in this plan."""
    @property
    def new_seq_ids(self) -> npt.NDArray[np.uint64]:
        """[K] their sequence ids."""
    @property
    def new_num_prompt_tokens(self) -> npt.NDArray[np.int32]:
        """[K] their prompt lengths."""
    @property
    def new_token_offsets(self) -> npt.NDArray[np.int64]:
        """[K+1] offsets into ``new_token_ids``."""
    @property
    def new_token_ids(self) -> npt.NDArray[np.int64]:
        """All known tokens of each new sequence (prompt, then outputs if resumed)."""
    @property
    def new_params(self) -> list[object]:
        """[K] each new sequence's ``sample_params`` entry (None where none was given)."""
    @property
    def freed_rows(self) -> npt.NDArray[np.int32]:
        """[F] rows released since the previous plan."""
    @property
    def mask_sample_indices(self) -> npt.NDArray[np.int32]:
        """[M] indices into the E entries whose logits a grammar constrains."""
    @property
    def grammar_mask(self) -> GrammarMaskTicket | None:
        """Where to take this step's ``[M, words]`` mask just before sampling (None when M is 0)."""
    @property
    def num_draft_tokens(self) -> npt.NDArray[np.int32]:
        """[S] drafts of each sampled sequence, in sample order; empty when the step has none."""
    @property
    def draft_token_ids(self) -> npt.NDArray[np.int64]:
        """[D] the drafts, flat, sequence by sequence (also in ``input_ids``)."""
    @property
    def propose_indices(self) -> npt.NDArray[np.int32]:
        """[Q] indices into the S sampled sequences (sample order) whose next step's drafts
        the executor proposes (method "executor"; empty otherwise): those that may draft."""
    @property
    def propose_counts(self) -> npt.NDArray[np.int32]:
        """[Q] at most this many drafts for each of ``propose_indices``' sequences: what the
        scheduler can take in their next step (room, and what the adaptive rule finds useful)."""
    @property
    def block_table_groups(self) -> npt.NDArray[np.int32]:
        """[B] with per-group tables (``SchedulerConfig.table_layout``): the table each
        block-table write is for; empty with one shared table."""
    @property
    def group_slot_mapping(self) -> npt.NDArray[np.int64]:
        """[T * (G - 1)] with G per-group tables: each token's KV slot in tables 1..G-1,
        token by token (``slot_mapping`` is table 0's); empty with one table."""
    @property
    def may_draft_indices(self) -> npt.NDArray[np.int32]:
        """[V] indices into ``rows`` of the sequences that may still draft (method
        "executor"; empty otherwise): not turned off, constrained, pooling or no_spec."""
    @property
    def num_seqs(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_samples(self) -> int: ...

@final
class OutputEvent:
    """What the output thread learns from one step result (``step_id`` None for events
    caused by ``abort`` / ``finish`` alone)."""

    #: The attribute names, in contract order.
    FIELDS: Final[list[str]]
    @property
    def step_id(self) -> int | None: ...
    @property
    def seq_ids(self) -> npt.NDArray[np.uint64]:
        """[K] sequences that accepted a token in this step."""
    @property
    def token_ids(self) -> npt.NDArray[np.int64]:
        """[K] the tokens (extras sampled after a sequence finished are dropped); a sequence
        appears once per token it accepted in the step, in order."""
    @property
    def sample_indices(self) -> npt.NDArray[np.int32]:
        """[K] which element of the step's ``sampled`` each token is; empty when the step had
        no drafts (each sequence then has one element, found by its id)."""
    @property
    def finished_seq_ids(self) -> npt.NDArray[np.uint64]:
        """[F] sequences that ended."""
    @property
    def finish_reasons(self) -> npt.NDArray[np.uint8]:
        """[F] codes into ``FINISH_REASONS``."""
    @property
    def stop_token_ids(self) -> npt.NDArray[np.int64]:
        """[F] the EOS / stop token that ended the sequence, -1 when none did."""
    @property
    def num_prompt_tokens(self) -> npt.NDArray[np.int32]: ...
    @property
    def num_cached_tokens(self) -> npt.NDArray[np.int32]:
        """[F] prompt tokens reused from the prefix cache or a sibling at admission."""
    @property
    def num_output_tokens(self) -> npt.NDArray[np.int32]: ...
    @property
    def num_preemptions(self) -> npt.NDArray[np.int32]: ...
    @property
    def step_result(self) -> object:
        """The ``result`` the executor gave ``submit_result`` / ``fail_step`` for this step
        (None for command events or when it gave none)."""
    @property
    def kv_events(
        self,
    ) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint64], npt.NDArray[np.uint64], npt.NDArray[np.uint32]] | None:
        """The prefix cache's changes since the previous event, ``(kinds, hashes, parents,
        tokens)``, when KV-cache events are on and there were any, else None
        (``docs/kv_events.md``)."""

@final
class Scheduler:
    """The scheduler driven synchronously from the calling thread (tests, benchmarks).

    Thread-safe: calls lock the scheduler inside; planning and result application run
    with the GIL released.
    """

    def __new__(
cls, config: SchedulerConfig) -> Self: ...
    def add_request(self, request: Request) -> int:
        """Adds a request; returns its first sequence id (the n samples follow)."""
    def schedule(self) -> StepPlan | None:
        """Plans the next step; None when the pipeline is full or nothing can run."""
    def apply_result(
        self,
        step_id: int,
        sampled: npt.ArrayLike,
        *,
        num_accepted: npt.ArrayLike | None = None,
        next_drafts: tuple[npt.ArrayLike, npt.ArrayLike] | None = None,
    ) -> None:
        """Applies the oldest in-flight step's sampled ids; ``num_accepted`` and
        ``next_drafts`` as for ``SchedulerThread.submit_result``."""
    def fail_step(self, step_id: int) -> None:
        """Ends every sequence of a step the executor could not run ("error")."""
    def take_output(self, step_id: int | None = None) -> OutputEvent:
        """Tokens accepted and sequences ended since the last call."""
    def abort(self, request_id: str) -> bool:
        """Aborts every sample; False if the request is not live (not an error)."""
    def finish(self, seq_id: int, reason: _FinishReason = "stop") -> bool:
        """Ends one sequence (a stop string); False if it had already ended."""
    def has_unfinished(self) -> bool: ...
    def stats(self) -> dict[str, int | float]:
        """Running / waiting counts, KV block usage, prefix-cache and step counters."""
    def check_invariants(self) -> None:
        """Raises ``StepResultError`` describing a broken internal invariant, if any."""
    def _panic(self) -> None:
        """Test hook: panics inside the core (raises ``NativePanicError``, an ``EngineError``)."""

@final
class SchedulerThread:
    """Starts the ``pyengine-sched`` thread; the engine's executor and output threads
    talk to it through these calls. Every blocking call releases the GIL and can be
    interrupted with Ctrl-C. After the thread ends, calls raise ``EngineDeadError``."""

    def __new__(
cls, config: SchedulerConfig) -> Self: ...
    @property
    def config(self) -> SchedulerConfig: ...
    def add_request(self, request: Request) -> int:
        """Validates and queues a request; returns its first sequence id.

        Raises ``InvalidRequestError`` / ``DuplicateRequestError`` at once."""
    def abort(self, request_id: str) -> None:
        """Queues an abort of every sample (ignored for finished requests)."""
    def finish(self, seq_id: int, reason: _FinishReason = "stop") -> None:
        """Queues the end of one sequence (the output thread found a stop string)."""
    def next_plan(self, timeout: float | None = None) -> StepPlan | None:
        """The next plan; None if ``timeout`` seconds pass first."""
    def submit_result(
        self,
        step_id: int,
        sampled: npt.ArrayLike,
        result: object = None,
        *,
        num_accepted: npt.ArrayLike | None = None,
        next_drafts: tuple[npt.ArrayLike, npt.ArrayLike] | None = None,
    ) -> None:
        """Hands back the ids sampled for ``step_id``; ``result`` reaches the output thread
        as that step's ``OutputEvent.step_result``.

        Without drafts ``sampled`` is in ``logits_indices`` order. With drafts,
        ``num_accepted`` ([S] ints) gives each sampled sequence's accepted drafts and
        ``sampled`` holds, per sequence, those drafts and then one more token (the
        correction or the bonus token): ``S + sum(num_accepted)`` ids. ``next_drafts`` =
        ``(counts [S], tokens)``: the executor's drafts for each sequence's next step
        (method ``executor``; ignored otherwise). A malformed result is a fatal executor
        bug, as a wrong sample count is."""
    def fail_step(self, step_id: int, result: object = None) -> None:
        """Reports that ``step_id`` could not run: its sequences end with "error", and
        ``result`` (what went wrong) travels in that step's event."""
    def next_output(self, timeout: float | None = None) -> OutputEvent | None:
        """The next output event; None if ``timeout`` seconds pass first."""
    def stats(self, timeout: float = 1.0) -> dict[str, int | float]:
        """Scheduler figures plus thread busy/idle seconds, queue depths, plan times."""
    def cached_block_hashes(self, timeout: float = 1.0) -> list[int] | None:
        """The published hashes of every block in the prefix cache, sorted: what a
        KV-event subscriber that saw every event so far holds. None if the thread did not
        answer within ``timeout`` seconds."""
    @property
    def is_alive(self) -> bool: ...
    @property
    def death(self) -> str | None:
        """Why the scheduler thread died (a panic message), or None."""
    def shutdown(self, timeout: float = 5.0) -> None:
        """Stops and joins the thread, also with work in flight."""
    def _inject_panic(self) -> None:
        """Test hook: makes the scheduler thread panic."""

@final
class GrammarCompiler:
    """The vocabulary, sent to Rust once per engine, and a cache of compiled constraints
    (llguidance). Thread-safe; compiling releases the GIL."""

    def __new__(
        cls,
        token_bytes: list[bytes],
        special_token_ids: list[int],
        eos_token_ids: list[int],
        vocab_size: int,
        cache_capacity: int = 256,
    ) -> Self:
        """``token_bytes[i]``: token i's bytes; ``special_token_ids`` are never produced as
        text; ``eos_token_ids`` end an output where the grammar may end; ``vocab_size``: the
        logits' width. Raises ``InvalidConfigError`` for inconsistent inputs."""
    def compile(
        self,
        kind: Literal["json", "json_object", "regex", "choice", "grammar"],
        text: str,
        *,
        disable_any_whitespace: bool = False,
        disable_additional_properties: bool = False,
        whitespace_pattern: str | None = None,
    ) -> CompiledConstraint:
        """Compiles (or finds in the cache) a constraint; ``choice`` takes a JSON list of
        strings, ``grammar`` llguidance's Lark. Raises ``InvalidRequestError`` naming what
        is wrong."""
    def is_cached(
        self,
        kind: Literal["json", "json_object", "regex", "choice", "grammar"],
        text: str,
        *,
        disable_any_whitespace: bool = False,
        disable_additional_properties: bool = False,
        whitespace_pattern: str | None = None,
    ) -> bool:
        """Whether ``compile`` with these arguments would be a cache hit (compiles nothing)."""
    @property
    def vocab_size(self) -> int: ...
    def stats(self) -> dict[str, int | float]:
        """compiled, cache_hits, failed, compile_seconds, cached_grammars."""

@final
class CompiledConstraint:
    """A compiled grammar; pass it to ``Request(constraint=...)``."""

    @property
    def kind(self) -> str: ...
    @property
    def cached(self) -> bool:
        """Served from the compile cache."""
    @property
    def compile_seconds(self) -> float:
        """Time the ``compile`` call took."""

@final
class GrammarMaskTicket:
    """The executor's end of one step's grammar mask (``StepPlan.grammar_mask``)."""

    def take(self, timeout: float = 30.0) -> tuple[npt.NDArray[np.uint32], float]:
        """Waits (GIL released) for ``(bits, compute_seconds)``: ``bits`` uint32 ``[M, words]``,
        bit ``t % 32`` of word ``t / 32`` allowing token t. Raises ``StepResultError`` if it
        does not come within ``timeout`` seconds, ``EngineDeadError`` if the scheduler stopped."""

def block_hashes(token_ids: list[int], block_size: int, cache_salt: str | None = None) -> list[int]:
    """The hashes KV-cache events publish for the full blocks of ``token_ids`` (the chain
    ``docs/kv_events.md`` documents)."""
