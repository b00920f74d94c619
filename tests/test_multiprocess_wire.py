"""The link's messages: parameters cross field by field (a field added later included),
arrays ride as raw buffer frames, and a peer can never make the front end build anything
but the wire's own types (no pickle)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import msgspec
import numpy as np
import pytest

from pyengine.errors import EngineError, InvalidRequestError, ModelLoadError
from pyengine.logprob_arrays import LogprobArrays
from pyengine.logprobs import Logprob
from pyengine.multiprocess import wire
from pyengine.multiprocess.wire_logprobs import logprobs_from_wire, logprobs_to_wire
from pyengine.outputs import EngineStats, ThreadStack
from pyengine.sampling_params import PoolingParams, SamplingParams

# A value unlike the default for each field known today; a field added later keeps its
# default here and still has to cross (the round trip compares the whole object).
NON_DEFAULTS = dict(n=3, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, repetition_penalty=1.1,
                    presence_penalty=0.5, frequency_penalty=-0.5, seed=42, max_tokens=77, min_tokens=2,
                    stop=["END", "\n\n"], stop_token_ids=[7, 9], include_stop_str_in_output=True,
                    ignore_eos=True, skip_special_tokens=False, logprobs=4, detokenize=False,
                    logit_bias={3: -12.5, 400: 100.0}, allowed_token_ids=[1, 5, 9], bad_words=["spam", "eggs ham"],
                    extra_args={"target_token": 4, "nested": {"a": [1, 2]}})


def _cross(message):
    """Encodes ``message`` as the front end does and decodes it as a core does."""
    frames = wire.Codec(wire.ToCore).encode(message)
    return wire.Codec(wire.ToCore).decode([bytes(f) for f in frames]), frames


def test_every_sampling_params_field_crosses_the_link():
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    params = SamplingParams(**{k: v for k, v in NON_DEFAULTS.items() if k in known})
    got, _ = _cross(wire.AddRequest("r", np.arange(3), params, False, "delta"))
    back = wire.params_from_builtins(SamplingParams, got.params)
    assert back == params
    for f in dataclasses.fields(SamplingParams):  # field by field, so a failure names it
        assert getattr(back, f.name) == getattr(params, f.name), f.name
    from pyengine.structured_outputs import StructuredOutputsParams

    for constraint in (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}},
                                               disable_any_whitespace=True),
                       StructuredOutputsParams(choice=["yes", "no"]), StructuredOutputsParams(regex="a+")):
        nested = SamplingParams(structured_outputs=constraint)
        got, _ = _cross(wire.AddRequest("s", np.arange(2), nested, False, "delta"))
        back = wire.params_from_builtins(SamplingParams, got.params)
        assert back == nested and isinstance(back.structured_outputs, StructuredOutputsParams)
    pooling = PoolingParams(pooling_type="mean", normalize=False)
    got, _ = _cross(wire.AddRequest("e", np.arange(3), pooling, True, "final"))
    assert wire.params_from_builtins(PoolingParams, got.params) == pooling


@dataclass
class _Inner:
    pattern: Optional[str] = None
    choices: list[str] = field(default_factory=list)


@dataclass
class _Outer:
    inner: Optional[_Inner] = None
    items: Optional[list[_Inner]] = None
    count: int = 0


def test_nested_parameter_dataclasses_cross_without_new_code():
    # What a nested field such as structured outputs needs: rebuilt as its own dataclass.
    params = _Outer(_Inner("a+", ["x", "y"]), [_Inner("b")], 3)
    got, _ = _cross(wire.AddRequest("r", np.arange(1), params, False, "delta"))
    back = wire.params_from_builtins(_Outer, got.params)
    assert back == params and isinstance(back.inner, _Inner) and isinstance(back.items[0], _Inner)


def test_an_unknown_field_is_refused_not_dropped():
    with pytest.raises(TypeError, match="no field.*bogus"):
        wire.params_from_builtins(SamplingParams, {"bogus": 1})


def test_params_are_validated_again_when_rebuilt():
    with pytest.raises(InvalidRequestError, match="temperature"):
        wire.params_from_builtins(SamplingParams, {"temperature": -1.0})


def test_arrays_are_raw_buffer_frames():
    ids = np.arange(100_000, dtype=np.int64)
    got, frames = _cross(wire.AddRequest("r", ids, SamplingParams(), False, "delta"))
    assert len(frames) == 2 and len(frames[0]) < 1000  # the msgpack head refers to the buffer
    assert bytes(frames[1]) == ids.tobytes()
    np.testing.assert_array_equal(got.prompt_token_ids, ids)


def test_outputs_stats_and_stacks_cross_as_their_types():
    stats = EngineStats(threads={"pyengine-exec": {"busy_s": 1.0, "idle_s": 2.0}}, steps=3, step_time_mean_ms=1.5,
                        step_time_p99_ms=2.5, num_running=1, num_waiting=0, num_preempted_waiting=0, preemptions=0,
                        kv_usage=0.25, kv_blocks_total=64, prefix_cache_hit_rate=0.5, prompt_tokens=10,
                        generated_tokens=20, queue_depths={"plans": 1}, scheduler={"steps_planned": 3.0},
                        pipeline_bubble_s=0.01, pipeline_bubbles=2)
    stacks = [ThreadStack("pyengine-sched", "scheduler", True), ThreadStack("x", "executor", False, 12, ["f\n"])]
    vector = np.linspace(-1, 1, 8, dtype=np.float32)
    sample = _arrays([1, 2], [-0.125, -0.5], [1, 2], [[1], [3]], [[-0.125], [-0.25]])
    prompt = _arrays([7], [-3.0], [40], [[1]], [[-0.5]])
    out = wire.WireOutput("r", True, [wire.WireCompletion(0, "hi", [1, 2], -0.5, logprobs_to_wire(sample),
                                                          "stop", "\n")],
                          (1.0, 2.0, 3.0, 4.0, 5.0, 6, 0), 6, vector, prompt_logprobs=logprobs_to_wire(prompt))
    messages = [wire.EngineCoreOutputs(0, [out], [wire.WireFailure("q", "EngineDeadError", "gone")]),
                wire.Reply(1, 7, stats=stats, stacks=stacks), wire.Status(0, 5, 1, None)]
    send, receive = wire.Codec(wire.ToFrontEnd), wire.Codec(wire.ToFrontEnd)
    for message in messages:
        frames = send.encode(message)
        got = receive.decode([bytes(f) for f in frames])
        if isinstance(message, wire.EngineCoreOutputs):
            np.testing.assert_array_equal(got.outputs[0].embedding, vector)
            got.outputs[0].embedding = message.outputs[0].embedding = None
            # Log-probabilities ride as raw array frames, and come back as they left.
            assert len(frames) == 1 + 1 + 2 * 5
            piece = {1: "a", 2: "b", 3: "c", 7: "d"}.get
            got_sample = logprobs_from_wire(got.outputs[0].completions[0].logprobs, piece)
            assert got_sample.to_dicts() == [{1: Logprob(-0.125, 1, "a")},
                                             {2: Logprob(-0.5, 2, "b"), 3: Logprob(-0.25, 1, "c")}]
            assert logprobs_from_wire(got.outputs[0].prompt_logprobs, None).to_dicts() == [
                {7: Logprob(-3.0, 40, None), 1: Logprob(-0.5, 1, None)}]
            got.outputs[0].completions[0].logprobs = message.outputs[0].completions[0].logprobs = None
            got.outputs[0].prompt_logprobs = message.outputs[0].prompt_logprobs = None
        assert got == message


def _arrays(ids: list[int], values: list[float], ranks: list[int], tops: list[list[int]],
            top_values: list[list[float]]) -> wire.WireLogprobs:
    return logprobs_to_wire(LogprobArrays(np.array(ids, dtype=np.int64), np.array(values, dtype=np.float32),
                                          np.array(ranks, dtype=np.int64), np.array(tops, dtype=np.int64),
                                          np.array(top_values, dtype=np.float32)))


def test_logprob_arrays_that_disagree_are_refused():
    w = _arrays([1, 2], [-0.5, -0.25], [1, 1], [[1], [2]], [[-0.5], [-0.25]])
    w.ranks = np.array([1], dtype=np.int64)  # two positions, one rank
    with pytest.raises(ValueError, match="disagree"):
        logprobs_from_wire(w, None)
    w.ranks = np.array([1.0, 2.0])  # not integers
    with pytest.raises(ValueError, match="ranks"):
        logprobs_from_wire(w, None)


def test_a_peer_cannot_send_anything_but_wire_types():
    codec = wire.Codec(wire.ToCore)
    with pytest.raises(msgspec.ValidationError):
        codec.decode([msgspec.msgpack.encode({"type": "os.system", "arg": "true"})])
    with pytest.raises(msgspec.ValidationError):  # an extension that is not an array reference
        codec.decode([msgspec.msgpack.encode(["Abort", msgspec.msgpack.Ext(5, b"x")])])
    with pytest.raises(NotImplementedError):
        codec.encode(wire.Abort([object()]))  # type: ignore[list-item]


def test_errors_cross_as_their_class_and_nothing_else():
    assert isinstance(wire.error_from_wire("ModelLoadError", "bad"), ModelLoadError)
    assert isinstance(wire.error_from_wire("InvalidRequestError", "bad"), InvalidRequestError)
    other = wire.error_from_wire("SystemExit", "x")
    assert type(other) is EngineError and "SystemExit" in str(other)
