"""``make_engine_client``: one factory for both engine clients, and ``LinkOptions``, the link's
options defined once (issue 22, item 2). ``AsyncEngine`` is always in-process: asking it
for engine-core processes is a clear error naming the factory (it used to return a
``MultiprocessEngine``, which is no ``AsyncEngine``). The multi-process client built by
the factory is exercised in ``test_multiprocess_engine.py``."""

from __future__ import annotations

import dataclasses

import pytest

from pyengine import AsyncEngine, EngineConfig, InvalidConfigError, LinkOptions, make_engine_client
from pyengine.entrypoints.engine_client import EngineClient
from pyengine.multiprocess import wire
from pyengine.multiprocess.link_options import LINK_FLAGS, link_options
from pyengine.server.cli import _parse
from pyengine.testing.checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("factory") / "qwen3", "qwen3", seed=11)


def test_in_process_is_an_async_engine(checkpoint):
    engine = make_engine_client(EngineConfig.from_kwargs(str(checkpoint), num_kv_blocks=32, max_num_seqs=2))
    try:
        assert isinstance(engine, AsyncEngine) and isinstance(engine, EngineClient)
        assert engine.tokenize("hello") == engine.tokenizer.encode("hello").ids
    finally:
        engine.shutdown()


def test_async_engine_refuses_multiprocess_naming_the_factory(checkpoint):
    with pytest.raises(InvalidConfigError, match="make_engine_client"):
        AsyncEngine(str(checkpoint), multiprocess=True)


def test_link_options_are_for_the_multiprocess_client_only(checkpoint):
    with pytest.raises(InvalidConfigError, match="multiprocess=True"):
        make_engine_client(EngineConfig(model=str(checkpoint)), link=LinkOptions())


def test_link_options_are_checked():
    with pytest.raises(InvalidConfigError, match="transport"):
        LinkOptions(transport="udp")
    with pytest.raises(InvalidConfigError, match="start_timeout"):
        LinkOptions(start_timeout=0)
    assert LinkOptions(core_cpus=[3, 1]).core_cpus == (3, 1)
    assert LinkOptions().heartbeat_timeout == wire.DEFAULT_HEARTBEAT_TIMEOUT_S


def test_serve_flags_are_the_link_options():
    ns = _parse(["--engine-transport", "tcp", "--engine-host", "0.0.0.0", "--engine-input-port", "7001",
                 "--engine-output-port", "7002", "--local-engine-cores", "1", "--engine-core-cpus", "0,1",
                 "--engine-start-timeout", "30", "--engine-heartbeat-timeout", "5"])[3]
    assert link_options(ns) == LinkOptions(transport="tcp", host="0.0.0.0", input_port=7001, output_port=7002,
                                           local_cores=1, core_cpus=(0, 1), start_timeout=30.0,
                                           heartbeat_timeout=5.0)
    defaults = link_options(_parse([])[3])
    assert defaults == LinkOptions()
    assert ns.host == "127.0.0.1"  # the HTTP server's --host is its own
    assert {f.name for f in dataclasses.fields(LinkOptions)} == {name for name, _, _ in LINK_FLAGS}
