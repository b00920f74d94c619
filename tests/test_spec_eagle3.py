"""EAGLE-3 (``speculative_config={"method": "eagle3", "model": HEAD, ...}``): a random head
written in the published layout (``pyengine.testing.eagle3_checkpoint``), loaded by the
real loader; its drafts equal a plain re-implementation's (transformers' target hidden
states, the head's math written out here) after steps that kept some drafts and rejected
others, over chunked prefills and a preemption; the engine's outputs are those of
speculation off (greedy and seeded, preemption, prefix caching, n > 1, structured
outputs); what does not fit is refused by name (tensor parallelism: tests/test_spec_tp_proposers.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pyengine import LLM, SamplingParams
from pyengine.errors import InvalidConfigError, ModelLoadError
from pyengine.executor.config import ExecutorConfig
from pyengine.executor.model_runner import ModelRunner
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.eagle3_checkpoint import write_eagle3_head
from pyengine.testing.hand_plan import HandPlanner

K = 3
VOCAB = 512
AUX = (0, 1, 3)  # layer 0's input is the embeddings: the capture's edge case
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("target") / "llama", "llama", seed=1, num_hidden_layers=4)


@pytest.fixture(scope="module")
def head(target, tmp_path_factory):
    """A head over a subset of the vocabulary (``d2t``), sharing the target's embedding."""
    return write_eagle3_head(tmp_path_factory.mktemp("head") / "eagle3", target, seed=2, draft_vocab_size=300,
                             aux_layer_ids=AUX)


def eagle(folder, k=K) -> dict:
    return {"method": "eagle3", "model": str(folder), "num_speculative_tokens": k}


# ----- a plain re-implementation of the head, to check the proposer's drafts -----------

class ReferenceHead:
    """The head's math written out over the whole sequence (no cache, no paging), fed by
    transformers' hidden states of the target (``hidden_states[i]`` enters layer ``i``)."""

    def __init__(self, target, head):
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32).eval()
        self.w = load_file(str(head / "model.safetensors"))
        self.config = json.loads((head / "config.json").read_text())
        ids = torch.arange(self.config["draft_vocab_size"])
        self.to_target = ids + self.w["d2t"] if "d2t" in self.w else ids

    def _norm(self, x, name):
        return F.rms_norm(x, x.shape[-1:], self.w[name], self.config["rms_norm_eps"])

    def _layer(self, embeds, hidden):
        c, w = self.config, self.w
        heads, kv, dim = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        n = embeds.shape[0]
        normed_hidden = self._norm(hidden, "midlayer.hidden_norm.weight")
        x = torch.cat([self._norm(embeds, "midlayer.input_layernorm.weight"), normed_hidden], dim=-1)
        if c.get("norm_before_residual"):
            hidden = normed_hidden  # the residual is the normed state
        q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(n, heads, dim)
        k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(n, kv, dim)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(n, kv, dim)
        inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        angles = torch.arange(n, dtype=torch.float32)[:, None] * inv[None, :]
        cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]

        def rotate(t):
            return t * cos + torch.cat([-t[..., dim // 2:], t[..., :dim // 2]], -1) * sin

        q, k = rotate(q), rotate(k)
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        att = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        residual = hidden + att.transpose(0, 1).reshape(n, heads * dim) @ w["midlayer.self_attn.o_proj.weight"].T
        normed = self._norm(residual, "midlayer.post_attention_layernorm.weight")
        mlp = (F.silu(normed @ w["midlayer.mlp.gate_proj.weight"].T) * (normed @ w["midlayer.mlp.up_proj.weight"].T)
               ) @ w["midlayer.mlp.down_proj.weight"].T
        residual = residual + mlp
        return self._norm(residual, "norm.weight"), residual

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The k greedy drafts after ``tokens`` (the last one just emitted)."""
        states = self.model(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        hidden = torch.cat([states[i][0] for i in AUX], dim=-1) @ self.w["fc.weight"].T
        embed = self.model.get_input_embeddings()
        embeds = embed(torch.tensor(tokens[1:]))
        out = []
        for _ in range(k):
            normed, pre = self._layer(embeds, hidden)
            draft = int(self.to_target[int((normed[-1] @ self.w["lm_head.weight"].T).argmax())])
            out.append(draft)
            embeds = torch.cat([embeds, embed(torch.tensor([draft]))])
            hidden = torch.cat([hidden, pre[-1:]])
        return out


def _runner(target, spec=None, rows=8) -> ModelRunner:
    return ModelRunner.from_pretrained(target, ExecutorConfig(max_num_seqs=rows, max_model_len=256, num_kv_blocks=96,
                                                              speculative_config=spec))


PROMPTS = [np.random.default_rng(i).integers(0, VOCAB, 5 + 9 * i).tolist() for i in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


def _plain_outputs(target, tokens: int) -> list[list[int]]:
    runner = _runner(target)
    planner = HandPlanner(num_blocks=runner.num_kv_blocks, max_rows=8)
    ids = [planner.add(p, GREEDY) for p in PROMPTS]
    while min(len(planner.output_tokens(i)) for i in ids) < tokens:
        plan = planner.next_plan()
        planner.record(plan, runner.execute(plan).sampled_token_ids)
    return [planner.output_tokens(i) for i in ids]


@pytest.mark.parametrize("residual", ["after hidden_norm", "before hidden_norm"])
def test_drafts_are_the_heads_after_kept_and_rejected_drafts(target, head, residual, tmp_path):
    """Each step verifies the plain run's next tokens with one corrupted at a random depth
    (so 0 to k are kept), prompts prefill in chunks of 7, one sequence is preempted and
    recomputed: after every step the proposer's drafts equal the reference head's on the
    sequence's committed tokens; and the outputs equal the plain run's. Both residual
    conventions (``norm_before_residual``)."""
    if residual == "before hidden_norm":
        head = write_eagle3_head(tmp_path / "nbr", target, seed=6, draft_vocab_size=300, aux_layer_ids=AUX,
                                 norm_before_residual=True)
    plain = _plain_outputs(target, MAX_TOKENS + K + 1)
    reference = ReferenceHead(target, head)
    runner = _runner(target, eagle(head))
    planner = HandPlanner(num_blocks=runner.num_kv_blocks, max_rows=8)
    ids = [planner.add(p, GREEDY) for p in PROMPTS]
    rng = np.random.default_rng(3)
    drafts: dict[int, list[int]] = {}
    kept, checked, step = [], 0, 0
    while min(len(planner.output_tokens(i)) for i in ids) < MAX_TOKENS:
        plan = planner.next_plan(max_chunk=7, drafts=drafts)
        out = runner.execute(plan)
        assert out.row_errors is None
        planner.record(plan, out.sampled_token_ids, out.num_accepted)
        if out.num_accepted is not None:
            kept += out.num_accepted.tolist()
        step += 1
        drafts = {}
        if out.next_drafts is None:
            continue
        counts, tokens = out.next_drafts
        offsets = np.concatenate([[0], np.cumsum(counts)])
        sampled_rows = np.asarray(plan.sample_rows)
        if len(plan.num_draft_tokens):
            sampled_rows = sampled_rows[np.concatenate([[0], np.cumsum(plan.num_draft_tokens + 1)[:-1]])]
        row_seq = {runner.batch.seq_ids[r]: n for n, r in enumerate(sampled_rows.tolist())}
        for seq_id in ids:
            n = row_seq.get(seq_id)
            if n is None:
                continue
            got = tokens[offsets[n]:offsets[n + 1]].tolist()
            assert got == reference.drafts(planner.tokens(seq_id), K), f"step {step}, sequence {seq_id}"
            checked += 1
            done = len(planner.output_tokens(seq_id))
            oracle = plain[ids.index(seq_id)][done:done + K]
            bad = int(rng.integers(0, K + 1))
            drafts[seq_id] = [t if j != bad else (t + 1) % VOCAB for j, t in enumerate(oracle)]
        if step == 6:
            planner.preempt(ids[1])  # recomputed from scratch: no carry, a fresh head cache
            drafts.pop(ids[1], None)
    assert [planner.output_tokens(i)[:MAX_TOKENS] for i in ids] == [p[:MAX_TOKENS] for p in plain]
    assert checked > 30
    assert set(kept) >= {0, 1, K}, "steps kept none, some and all of their drafts"


# ----- loading: the published layout, and what does not fit -----------------------

def test_a_head_with_its_own_embedding_and_the_full_vocabulary_loads(target, tmp_path):
    folder = write_eagle3_head(tmp_path / "own", target, own_embedding=True, aux_layer_ids=AUX)
    runner = _runner(target, eagle(folder))
    proposer = runner.proposer
    assert proposer.aux_layers == AUX and proposer.head.embed_tokens is not None
    assert torch.equal(proposer.head.draft_to_target, torch.arange(VOCAB))
    assert runner.kv_groups == [(None, 4), (None, 1)]


def test_a_head_shipped_like_the_authors_loads(target, tmp_path):
    """``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B`` ships pytorch_model.bin and a config with
    Llama 3's rope scaling, float16, token ids and transformers' bookkeeping: all read or
    ignored as they should be; the drafts still follow the head (its weights in float32)."""
    folder = write_eagle3_head(
        tmp_path / "authors", target, seed=4, draft_vocab_size=256, aux_layer_ids=AUX, bin_file=True,
        torch_dtype="float16", bos_token_id=1, eos_token_id=2, pad_token_id=0, transformers_version="4.28.1",
        model_type="llama", pretraining_tp=1, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                            "original_max_position_embeddings": 64})
    assert not (folder / "model.safetensors").exists()
    runner = _runner(target, eagle(folder))
    head = runner.proposer.head
    assert head.config.layer.rope.rope_type == "llama3" and head.config.draft_vocab_size == 256
    assert int(head.draft_to_target.max()) < VOCAB and len(set(head.draft_to_target.tolist())) == 256
    planner = HandPlanner(num_blocks=runner.num_kv_blocks, max_rows=8)
    planner.add(PROMPTS[1], GREEDY)
    plan = planner.next_plan()
    counts, tokens = runner.execute(plan).next_drafts
    assert counts.tolist() == [K] and set(tokens.tolist()) <= set(head.draft_to_target.tolist())


def test_the_default_aux_layers_are_vllms(tmp_path):
    target = make_tiny_checkpoint(tmp_path / "t8", "llama", num_hidden_layers=8)
    folder = write_eagle3_head(tmp_path / "h8", target)
    assert _runner(target, eagle(folder)).proposer.aux_layers == (2, 4, 5)


@pytest.mark.parametrize("overrides, names", [
    ({"architectures": ["LlamaForCausalLM"]}, "architectures must be one of"),
    ({"hidden_size": 32}, "hidden_size must be the target's"),
    ({"vocab_size": 300}, "vocab_size must be the target's"),
    ({"target_hidden_size": 32}, "target_hidden_size"),
    ({"num_hidden_layers": 2}, "num_hidden_layers must be 1"),
    ({"draft_vocab_size": 600}, "draft_vocab_size"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 1, 2]}}, "3 distinct layer indices"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 4]}}, "0 to 3"),
    ({"eagle_config": {"use_aux_hidden_state": False}}, "use_aux_hidden_state"),
])
def test_heads_that_do_not_fit_are_refused_by_field(target, tmp_path, overrides, names):
    folder = write_eagle3_head(tmp_path / "bad", target, aux_layer_ids=AUX)
    config = json.loads((folder / "config.json").read_text())
    config.update(overrides)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidConfigError, match=names):
        _runner(target, eagle(folder))


def test_the_default_layers_of_a_small_target_are_refused(target, tmp_path):
    """(2, n // 2, n - 3) for 4 layers repeats layer 2: the head must name its layers."""
    with pytest.raises(InvalidConfigError, match="default"):
        _runner(target, eagle(write_eagle3_head(tmp_path / "h", target)))


def test_missing_and_misshapen_tensors_are_listed(target, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = write_eagle3_head(tmp_path / "h", target, draft_vocab_size=300, aux_layer_ids=AUX)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["d2t"], tensors["midlayer.hidden_norm.weight"]
    tensors["fc.weight"] = tensors["fc.weight"][:, :64].contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="midlayer.hidden_norm.weight.*d2t|fc.weight expected"):
        _runner(target, eagle(folder))


def test_a_d2t_outside_the_vocabulary_is_refused(target, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = write_eagle3_head(tmp_path / "h", target, draft_vocab_size=300, aux_layer_ids=AUX)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["d2t"][-1] = VOCAB
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="d2t maps draft ids outside"):
        _runner(target, eagle(folder))


def test_latent_attention_targets_are_refused(target, head, tmp_path):
    mla = make_tiny_checkpoint(tmp_path / "mla", "deepseek_v2")
    with pytest.raises(InvalidConfigError, match="latent-attention target"):
        ModelRunner.from_pretrained(mla, ExecutorConfig(max_num_seqs=2, max_model_len=64, num_kv_blocks=16,
                                                        speculative_config=eagle(head)))


# ----- through the engine --------------------------------------------------------

ENGINE_GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, VOCAB, int(rng.integers(4, 40))).tolist() for _ in range(16)]


def generate(target, prompts, params=ENGINE_GREEDY, **engine_args):
    with LLM(str(target), **engine_args) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
    return [[list(c.token_ids) for c in o.outputs] for o in outs], stats


@pytest.fixture(scope="module")
def reference(target, prompts):
    return generate(target, prompts)[0]


def test_engine_greedy_outputs_equal_speculation_off(target, head, prompts, reference):
    got, stats = generate(target, prompts, speculative_config=eagle(head))
    assert got == reference
    assert stats.scheduler["spec_drafts"] > 0 and stats.scheduler["spec_draft_tokens"] > 0
    assert stats.kv_usage == 0.0


def test_engine_preemption_prefix_caching_and_n(target, head, prompts, reference):
    got, stats = generate(target, prompts, speculative_config=eagle(head), num_kv_blocks=20, max_num_seqs=8,
                          block_size=16)
    assert got == reference
    assert stats.preemptions > 0 and stats.kv_usage == 0.0
    with LLM(str(target), speculative_config=eagle(head)) as llm:
        first = llm.generate(prompts[:6], ENGINE_GREEDY, use_tqdm=False)
        again = llm.generate(prompts[:6], ENGINE_GREEDY, use_tqdm=False)
        stats = llm.stats()
    assert [[list(c.token_ids) for c in o.outputs] for o in first + again] == reference[:6] * 2
    assert stats.prefix_cache_hit_rate > 0
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)
    got, _ = generate(target, prompts[:4], params, speculative_config=eagle(head))
    assert got == [ref * 2 for ref in reference[:4]]


def test_engine_seeded_sampling_and_structured_outputs(target, head, prompts):
    from pyengine.sampling_params import StructuredOutputsParams

    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True)
    off, _ = generate(target, prompts[:6], params)
    on, stats = generate(target, prompts[:6], params, speculative_config=eagle(head))
    assert on == off
    assert stats.scheduler["spec_draft_tokens"] > 0
    constrained = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                 structured_outputs=StructuredOutputsParams(regex="[a-c]{4,12}"))
    mixed = [constrained, ENGINE_GREEDY]
    off, _ = generate(target, prompts[:2], mixed)
    on, _ = generate(target, prompts[:2], mixed, speculative_config=eagle(head))
    assert on == off


def test_decode_steps_capture_the_same_states_through_the_native_path(target, head, monkeypatch):
    """Plain decode steps (no drafts) take the native decode path with EAGLE-3 on; the
    states it captures are bit-identical to the modules' (the path off)."""
    from pyengine.models.decode_path import NativeDecodePath

    taken = []
    original = NativeDecodePath.forward

    def counted(path, *args, **kwargs):
        out = original(path, *args, **kwargs)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(NativeDecodePath, "forward", counted)
    captured = []
    for native in (True, False):
        runner = ModelRunner.from_pretrained(target, ExecutorConfig(
            max_num_seqs=4, max_model_len=256, num_kv_blocks=96, attention_backend="sdpa",
            speculative_config=eagle(head)))
        assert runner.model.decode_path is not None
        if not native:
            runner.model.decode_path = None
        after_step = runner.proposer.after_step
        states, drafts = [], []

        def recording(step, output, batch, _after=after_step, _states=states, _drafts=drafts):
            _states.append(step.aux_hidden.clone())
            result = _after(step, output, batch)
            _drafts.append(result[1].tolist())
            return result

        runner.proposer.after_step = recording
        planner = HandPlanner(num_blocks=96, max_rows=4)
        for p in PROMPTS[:3]:
            planner.add(p, GREEDY)
        for _ in range(8):
            plan = planner.next_plan()
            planner.record(plan, runner.execute(plan).sampled_token_ids)
        captured.append((states, drafts))
    assert sum(taken) >= 7  # the decode steps took the path (with capture)
    (states_a, drafts_a), (states_b, drafts_b) = captured
    assert drafts_a == drafts_b
    for a, b in zip(states_a, states_b):
        assert torch.equal(a, b)


def test_a_step_whose_sequences_never_draft_again_captures_nothing(target, head, monkeypatch):
    """``may_draft_indices`` (the scheduler's: the sequences not turned off, constrained,
    pooling or no_spec): a row outside it has its prompt mirrored (a prefix-cache hit may
    reuse it) but not its outputs; with no row in it past its prompt, the target runs its
    plain forward and the head mirrors nothing."""
    from pyengine.models.decoder import DecoderForCausalLM

    runner = _runner(target, eagle(head))
    captures = []
    original = DecoderForCausalLM.forward_capturing

    def counted(model, *args, **kwargs):
        captures.append(bool(args[4:] and args[4]) or bool(kwargs.get("aux_layers")))
        return original(model, *args, **kwargs)

    monkeypatch.setattr(DecoderForCausalLM, "forward_capturing", counted)
    planner = HandPlanner(num_blocks=runner.num_kv_blocks, max_rows=8)
    for p in PROMPTS[:2]:
        planner.add(p, GREEDY)
    cache = runner.proposer.kv_cache
    written = []
    for step in range(4):
        plan = planner.next_plan()
        plan.may_draft_indices = np.array([1] if step < 3 else [], dtype=np.int32)  # row 0 never drafts
        plan.propose_indices = plan.may_draft_indices
        before = cache.keys.clone()
        out = runner.execute(plan)
        planner.record(plan, out.sampled_token_ids)
        row0 = int(plan.rows[0])
        position = int(plan.positions[plan.query_start_loc[0]]) - 1  # row 0's first pair's head position
        block = int(runner.batch.block_table[row0, position // 16])
        slot = position % 16
        written.append(not torch.equal(cache.keys[0, block, slot], before[0, block, slot]))
        if step < 3:
            assert out.next_drafts[0].tolist() == [0, K]
        else:  # nothing proposed: None, which the scheduler reads as no drafts for anyone
            assert out.next_drafts is None
    # step 0: the prompts (row 0's first pair is skipped: no carry at position 0); step 1:
    # row 0's last prompt position; step 2: an output position, not mirrored; step 3: nothing
    assert written[1:] == [True, False, False]
    assert captures[-4:] == [True, True, True, False]

def test_the_proposer_stops_at_the_counts_the_plan_asks_for(target, head):
    """``propose_counts`` (the scheduler's: what it can take next step) caps each named
    sequence's drafts: fewer head forwards, the same first drafts."""
    outputs = []
    for counts in (None, np.array([1, 3], dtype=np.int32)):
        runner = _runner(target, eagle(head))
        planner = HandPlanner(num_blocks=runner.num_kv_blocks, max_rows=8)
        for p in PROMPTS[:2]:
            planner.add(p, GREEDY)
        plan = planner.next_plan()
        plan.propose_indices = np.array([0, 1], dtype=np.int32)
        plan.propose_counts = counts
        outputs.append(runner.execute(plan).next_drafts)
    (all_counts, all_tokens), (counts, tokens) = outputs
    assert all_counts.tolist() == [K, K] and counts.tolist() == [1, 3]
    assert tokens.tolist() == [all_tokens[0]] + all_tokens[K:].tolist()
