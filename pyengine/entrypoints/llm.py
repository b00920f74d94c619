"""``LLM``: the offline API (vLLM-compatible: ``generate``, ``chat``, ``embed`` / ``encode``,
``get_tokenizer``, ``get_default_sampling_params``)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

from pyengine.beam_search.driver import Batch, Candidates, candidates_of
from pyengine.beam_search.outputs import BeamSearchOutput
from pyengine.beam_search.params import BeamSearchParams
from pyengine.config import EngineConfig
from pyengine.engine.core import EngineCore
from pyengine.entrypoints.llm_unsupported import UnsupportedVllmMethods
from pyengine.errors import EngineDeadError, InvalidRequestError
from pyengine.inputs.prompts import PromptType, is_single_prompt, normalize_prompt
from pyengine.outputs import EmbeddingRequestOutput, EngineStats, RequestOutput
from pyengine.sampling_params import PoolingParams, SamplingParams

if TYPE_CHECKING:
    from pyengine.entrypoints.progress import Progress
    from pyengine.inputs.chat_template import ChatTemplate
    from pyengine.inputs.chat_text import ChatTokenizer

Conversation = Sequence[Mapping[str, Any]]  # [{"role": "user", "content": "..."}, ...], as OpenAI's
_WAIT_SLICE_S = 0.2  # how often the waiting caller refreshes the progress bar


class _BatchCollector:
    """Collects the final outputs of one ``generate`` / ``embed`` call (output thread ->
    calling thread)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.results: dict[str, Any] = {}
        self.finished: list[str] = []  # request ids in the order they finished (the progress reads it)
        self.error: Optional[BaseException] = None
        self.output_tokens = 0

    def put(self, output: Any) -> None:
        with self.cond:
            if output.request_id not in self.results:
                self.finished.append(output.request_id)
            self.results[output.request_id] = output
            if isinstance(output, RequestOutput):
                self.output_tokens += sum(len(o.token_ids) for o in output.outputs)
            self.cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = error
            self.cond.notify_all()


class LLM(UnsupportedVllmMethods):
    """Load a model and generate from Python, in batches.

    ``LLM(model=None, **engine_args)``: ``model`` is a Hugging Face checkpoint folder, or
    None for the built-in tiny default. Engine arguments are the fields of
    :class:`~pyengine.config.EngineConfig` (unknown ones are an error).
    """

    def __init__(self, model: Optional[Union[str, Path]] = None, **engine_args: Any) -> None:
        self.config = EngineConfig.from_kwargs(model, **engine_args)
        self.engine_core = EngineCore(self.config)
        self._request_ids = itertools.count()
        self._hf_tokenizer: Any = None  # built on first get_tokenizer()
        self._checkpoint_template: Optional[ChatTemplate] = None  # compiled on first chat()
        self._chat_tokenizer: Optional[ChatTokenizer] = None

    @classmethod
    def from_engine_core(cls, core: EngineCore) -> LLM:
        """Wraps an already built engine (e.g. one with a synthetic executor)."""
        llm = cls.__new__(cls)
        llm.config, llm.engine_core, llm._request_ids = core.config, core, itertools.count()
        llm._hf_tokenizer = llm._checkpoint_template = llm._chat_tokenizer = None
        return llm

    def get_tokenizer(self) -> Any:
        """The checkpoint's tokenizer as a transformers ``PreTrainedTokenizerFast`` (as vLLM
        returns): ``encode`` / ``decode`` on lists, ``eos_token_id``, ``apply_chat_template``.
        Built once from the same tokenizer.json the engine uses; None without a tokenizer."""
        if getattr(self, "_hf_tokenizer", None) is None:
            from pyengine.inputs.tokenizer import hf_tokenizer

            engine = self.engine_core
            self._hf_tokenizer = hf_tokenizer(self._checkpoint_folder(), engine.tokenizer, engine.tokenizer_config)
        return self._hf_tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """A new ``SamplingParams()`` (what ``generate`` and ``chat`` use when given none),
        with the checkpoint's generation_config.json sampling defaults (temperature, top_p,
        top_k, min_p, repetition_penalty, max_new_tokens) when the loader provides them, as
        vLLM does; the plain defaults otherwise."""
        defaults = self._generation_defaults()
        return SamplingParams(**defaults) if defaults else SamplingParams()

    def _generation_defaults(self) -> dict[str, Any]:
        return dict(self.engine_core.generation_defaults)

    def _checkpoint_folder(self) -> Optional[Path]:
        folder = Path(self.engine_core.tokenizer_path)
        return folder if folder.is_dir() else None

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        use_tqdm: Any = True,
        priority: Optional[Sequence[int]] = None,
    ) -> list[RequestOutput]:
        """Generates for each prompt; returns the outputs in input order.

        ``prompts``: a string, a list of token ids, a ``{"prompt_token_ids": ...}`` dict, or a
        list of those. ``sampling_params``: one for all, or one per prompt. Raises the error
        of the first request that fails (the others are aborted). Ctrl-C aborts the batch
        and leaves the engine usable.
        """
        items = [prompts] if is_single_prompt(prompts) else list(prompts)  # type: ignore[list-item]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _per_prompt(sampling_params, len(items), "sampling_params")
        priorities = list(priority) if priority is not None else [0] * len(items)
        if len(priorities) != len(items):
            raise InvalidRequestError(f"priority has {len(priorities)} entries for {len(items)} prompts")
        return self._run(items, params, priorities, use_tqdm, "generate")

    def embed(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None,
        *,
        use_tqdm: Any = True,
    ) -> list[EmbeddingRequestOutput]:
        """Pooled, (by default) L2-normalised hidden states of each prompt."""
        items = [prompts] if is_single_prompt(prompts) else list(prompts)  # type: ignore[list-item]
        params = _per_prompt(pooling_params or PoolingParams(), len(items), "pooling_params")
        return self._run(items, params, [0] * len(items), use_tqdm, "embed")

    def encode(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None,
        *,
        use_tqdm: Any = True,
        pooling_task: Optional[str] = None,
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's pooling entry point; here the same as :meth:`embed` (the one pooling task
        this engine has)."""
        if pooling_task not in (None, "embed"):
            raise InvalidRequestError(f"pooling_task must be 'embed' (the only pooling task here), got {pooling_task!r}")
        return self.embed(prompts, pooling_params, use_tqdm=use_tqdm)

    def chat(
        self,
        messages: Union[Conversation, Sequence[Conversation]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: Any = True,
        lora_request: Any = None,
        chat_template: Optional[str] = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Optional[list[dict[str, Any]]] = None,
        chat_template_kwargs: Optional[dict[str, Any]] = None,
        mm_processor_kwargs: Any = None,
    ) -> list[RequestOutput]:
        """Generates a reply to each conversation, as vLLM's ``LLM.chat``: renders it with the
        checkpoint's chat template (or ``chat_template``, the template's text or a file
        holding it, read as the server reads ``--chat-template``), tokenizes the text (the
        template's special tokens parsed, none added; one typed inside a message stays
        text, as on the server: ``pyengine.inputs.chat_template.render_chat``) and
        generates; returns the outputs in input order.

        ``messages``: one conversation (a list of ``{"role", "content"}`` dicts) or a list
        of them. ``content`` may be a string or a list of ``{"type": "text", "text": ...}``
        parts (joined with newlines; other part types are refused: the model takes text
        only). ``tools`` and ``chat_template_kwargs`` reach the template.
        ``continue_final_message`` ends the prompt inside the last message (with
        ``add_generation_prompt=False``), so the model continues it.
        """
        if lora_request is not None:
            raise InvalidRequestError("lora_request is not supported: this engine serves no LoRA adapters")
        if mm_processor_kwargs is not None:
            raise InvalidRequestError("mm_processor_kwargs is not supported: the model takes text only")
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise InvalidRequestError("chat_template_content_format must be 'auto', 'string' or 'openai', "
                                      f"got {chat_template_content_format!r}")
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError("continue_final_message and add_generation_prompt are not compatible: "
                                      "pass add_generation_prompt=False to continue the final message")
        if self.engine_core.tokenizer is None:
            raise InvalidRequestError("this checkpoint has no tokenizer.json: LLM.chat needs one")
        from pyengine.inputs.chat_template import render_chat

        conversations = _conversations(messages)
        template, tokens = self._chat_template(chat_template), self._chat_tokens()
        items = []
        for i, conversation in enumerate(conversations):
            chat = render_chat(template, tokens, conversation, add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, tools=tools,
                               template_kwargs=chat_template_kwargs,
                               keep_parts=chat_template_content_format == "openai",
                               where="messages" if len(conversations) == 1 else f"messages[{i}]")
            items.append({"prompt": chat.text, "prompt_token_ids": chat.token_ids})
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _per_prompt(sampling_params, len(items), "sampling_params")
        return self._run(items, params, [0] * len(items), use_tqdm, "chat")

    def _chat_template(self, given: Optional[str]) -> ChatTemplate:
        """``chat_template`` (a file or its text, read as the server reads --chat-template),
        else the checkpoint's, chosen as the server chooses it (compiled once)."""
        from pyengine.inputs.chat_template import ChatTemplate, choose_chat_template, load_chat_template

        if given is not None:
            return ChatTemplate(load_chat_template(given, "chat_template"), self.engine_core.tokenizer_config,
                                "chat_template")
        if self._checkpoint_template is None:
            config = self.engine_core.tokenizer_config
            choice = choose_chat_template(None, self._checkpoint_folder(), config.get("chat_template"))
            if choice is None:
                raise InvalidRequestError("this checkpoint has no chat template (no chat_template in "
                                          "tokenizer_config.json nor chat_template.jinja): pass chat_template=")
            self._checkpoint_template = ChatTemplate(choice.source, config, f"the checkpoint's {choice.origin} template")
        return self._checkpoint_template

    def _chat_tokens(self) -> ChatTokenizer:
        """The tokenizer chats are encoded with (built once: it copies the tokenizer)."""
        if self._chat_tokenizer is None:
            from pyengine.inputs.chat_text import ChatTokenizer

            self._chat_tokenizer = ChatTokenizer(self.engine_core.tokenizer)
        return self._chat_tokenizer

    def _run(self, items: list, params: list, priorities: list[int], use_tqdm: Any, what: str) -> list:
        engine = self.engine_core
        normalized = [normalize_prompt(p, engine.tokenize) for p in items]  # validate all first
        collector = _BatchCollector()
        ids: list[str] = []
        progress = _progress(use_tqdm, what)
        try:
            if progress is not None:
                progress.start([len(t) for _, t in normalized], params, int(getattr(engine, "max_model_len", 0) or 0))
            for (text, token_ids), p, prio in zip(normalized, params, priorities):
                rid = str(next(self._request_ids))
                engine.add_request(rid, text, token_ids, p, collector, kind="final", priority=prio,
                                   fit_to_length=True)
                ids.append(rid)
            self._wait(collector, ids, progress)
        except BaseException:
            for rid in ids:
                if rid not in collector.results:
                    engine.abort(rid)
            raise
        finally:
            if progress is not None:
                progress.close()
        return [collector.results[rid] for rid in ids]

    def _wait(self, collector: _BatchCollector, ids: list[str], progress: Optional[Progress]) -> None:
        """Waits for every request of the batch, refreshing ``progress`` with what finished
        and the tokens the engine generated meanwhile (its counter, so the display moves
        while requests run)."""
        output_loop = getattr(self.engine_core, "output", None)
        generated_at_start = getattr(output_loop, "generated_tokens", 0)
        index = {rid: i for i, rid in enumerate(ids)}
        reported = 0  # collector.finished[:reported] went to the progress already

        def report() -> None:  # called with collector.cond held: reads only what is new
            nonlocal reported
            if progress is None:
                return
            new = [(index[rid], collector.results[rid]) for rid in collector.finished[reported:]]
            reported += len(new)
            generated = getattr(output_loop, "generated_tokens", 0) - generated_at_start
            progress.update(new, max(generated, collector.output_tokens))

        with collector.cond:
            while len(collector.results) < len(ids):
                if collector.error is not None:
                    raise collector.error
                collector.cond.wait(_WAIT_SLICE_S)
                report()
                if collector.error is None and len(collector.results) < len(ids) and not self.engine_core.is_alive:
                    raise EngineDeadError(self.engine_core.dead_reason() or "the engine stopped")
            if collector.error is not None:
                raise collector.error
            report()

    def beam_search(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        params: BeamSearchParams,
        lora_request: Any = None,
        use_tqdm: bool = False,
        concurrency_limit: Optional[int] = None,
    ) -> list[BeamSearchOutput]:
        """Beam search for each prompt, as vLLM's ``LLM.beam_search``: one
        ``BeamSearchOutput`` per prompt, in input order, holding ``params.beam_width``
        sequences best first (see docs/beam_search.md). ``prompts`` as for ``generate``;
        ``concurrency_limit``: prompts searched at a time (all by default). Every step runs
        the live beams of all prompts as one batch; the prefix cache shares their blocks."""
        from pyengine.beam_search.offline import run_offline

        if lora_request is not None:
            raise InvalidRequestError("lora_request is not supported: this engine serves no LoRA adapters")
        return run_offline(self.engine_core, prompts, params, self._beam_step, use_tqdm, concurrency_limit)

    def _beam_step(self, batch: Batch) -> list[Candidates]:
        """One beam-search step: the batch's sequences as one ``generate``-like batch."""
        sequences, params = batch
        outs = self._run([{"prompt_token_ids": ids} for ids in sequences], [params] * len(sequences),
                         [0] * len(sequences), False, "beam_search")
        return [candidates_of(out) for out in outs]

    def stats(self) -> EngineStats:
        """Per-thread busy/idle time, step times, queue depths, KV usage, cache hit rate."""
        return self.engine_core.stats()

    def shutdown(self, timeout: float = 10.0) -> None:
        self.engine_core.shutdown(timeout)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _progress(use_tqdm: Any, what: str) -> Optional[Progress]:
    """``use_tqdm``: True (vLLM's bar over finished requests), False (none), a tqdm-like
    class (vLLM's ``use_tqdm=<callable>``: the bar it makes), or a progress object with
    ``start`` / ``update`` / ``close`` (``pyengine.entrypoints.progress``)."""
    from pyengine.entrypoints.progress import RequestBar

    if use_tqdm is True:
        return RequestBar(what)
    if use_tqdm is False or use_tqdm is None:
        return None
    if all(callable(getattr(use_tqdm, name, None)) for name in ("start", "update", "close")):
        return use_tqdm
    if callable(use_tqdm):
        return RequestBar(what, bar_factory=use_tqdm)
    raise InvalidRequestError(f"use_tqdm must be a bool, a tqdm-like class or a progress object, got {use_tqdm!r}")


def _per_prompt(params: Any, count: int, name: str) -> list:
    if isinstance(params, (SamplingParams, PoolingParams)):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise InvalidRequestError(f"{name} has {len(params)} entries for {count} prompts")
    return params


def _conversations(messages: Any) -> list[Conversation]:
    """One conversation or a list of them (vLLM tells them apart by the first item)."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise InvalidRequestError("messages must be a list of {'role', 'content'} dicts or a list of such lists, "
                                  f"got {type(messages).__name__}")
    if messages and not isinstance(messages[0], Mapping):
        return list(messages)
    return [messages]
