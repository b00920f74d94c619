"""Hugging Face hub ids (``LLM("ORG/NAME")``, ``pyengine serve ORG/NAME``) resolve through a
local hub cache written here; the network is never touched (HF_HUB_OFFLINE=1, and the
online path is exercised with a stand-in for ``huggingface_hub``'s calls)."""

from __future__ import annotations

import sys

import httpx
import pytest

from pyengine import LLM, SamplingParams
from pyengine.config import EngineConfig
from pyengine.errors import InvalidConfigError, ModelLoadError
from pyengine.models import hub
from pyengine.testing.checkpoints import make_tiny_checkpoint

REPO = "tiny-org/tiny-qwen3"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen3", "qwen3", seed=7)


def write_cache_entry(cache, repo, source, *, commit=COMMIT, only=None):
    """The hub cache layout: models--ORG--NAME/{refs/main, snapshots/<commit>/...}."""
    storage = cache / ("models--" + repo.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for path in source.iterdir():
        if only is None or path.name in only:
            (snapshot / path.name).write_bytes(path.read_bytes())
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tiny):
    home = tmp_path / "hf"
    cache = home / "hub"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # relative ids must not resolve against the repository
    write_cache_entry(cache, REPO, tiny)
    return cache


def test_hub_ids_are_told_from_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub.looks_like_hub_id("Qwen/Qwen3-0.6B")
    assert hub.looks_like_hub_id("meta-llama/Llama-3.2-1B-Instruct")
    for not_an_id in ("/abs/path", "./org/name", "~/models/x", "a/b/c", "name", "org/../x", "org/", ""):
        assert not hub.looks_like_hub_id(not_an_id), not_an_id
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not hub.looks_like_hub_id("org/name")  # an existing folder stays a folder
    from pathlib import Path

    assert not hub.looks_like_hub_id(Path("Qwen/Qwen3-0.6B"))  # a Path is meant as a path
    assert hub.resolve_model("/not/there") == "/not/there"
    assert hub.resolve_model(None) is None


def test_cached_hub_id_resolves_to_its_snapshot(hub_cache, tiny):
    snapshot = hub_cache / "models--tiny-org--tiny-qwen3" / "snapshots" / COMMIT
    assert hub.resolve_model(REPO) == snapshot
    config = EngineConfig.from_kwargs(REPO, max_num_seqs=4)
    assert config.model == snapshot


def test_llm_generates_from_a_hub_id_like_from_the_folder(hub_cache, tiny):
    params = SamplingParams(temperature=0.0, max_tokens=8)
    engine_args = dict(max_num_seqs=4, max_model_len=64, num_kv_blocks=32)
    with LLM(REPO, **engine_args) as llm:
        from_hub = [o.outputs[0].token_ids for o in llm.generate(["Hello", "你好"], params, use_tqdm=False)]
    with LLM(str(tiny), **engine_args) as llm:
        from_folder = [o.outputs[0].token_ids for o in llm.generate(["Hello", "你好"], params, use_tqdm=False)]
    assert from_hub == from_folder and all(from_hub)


def test_generate_command_takes_a_hub_id(hub_cache, capsys):
    from pyengine.cli.main import main

    assert main(["generate", "--model", REPO, "--prompt", "Hi", "--max-tokens", "3"]) == 0
    assert "--- 'Hi'" in capsys.readouterr().out


def test_id_missing_from_the_cache_offline_is_named(hub_cache):
    with pytest.raises(ModelLoadError, match=r"'tiny-org/absent'.*holds nothing.*HF_HUB_OFFLINE=1"):
        LLM("tiny-org/absent")


def test_serve_names_the_missing_id(hub_cache, capsys):
    from pyengine.cli.main import main

    assert main(["serve", "tiny-org/absent", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "'tiny-org/absent'" in err and "Traceback" not in err and err.count("\n") == 1


def test_incomplete_snapshot_needs_weights_unless_dummy(hub_cache, tiny):
    write_cache_entry(hub_cache, "tiny-org/config-only", tiny, only={"config.json", "tokenizer.json"})
    with pytest.raises(ModelLoadError, match="incomplete snapshot"):
        EngineConfig.from_kwargs("tiny-org/config-only")
    config = EngineConfig.from_kwargs("tiny-org/config-only", load_format="dummy")
    assert (config.model / "config.json").is_file()


def test_other_arguments_are_checked_before_resolving(hub_cache):
    with pytest.raises(InvalidConfigError, match="pipeline_depth"):
        EngineConfig.from_kwargs("tiny-org/absent", pipeline_depth=3)


def test_unresolved_id_in_the_constructor_says_how(hub_cache):
    with pytest.raises(InvalidConfigError, match="hub id.*from_kwargs"):
        EngineConfig(model="tiny-org/absent")


def test_without_huggingface_hub_the_error_says_to_install_it(hub_cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(ModelLoadError, match="install huggingface_hub"):
        hub.resolve_model(REPO)
    assert hub.resolve_model("/a/folder") == "/a/folder"  # folders never need it


class FakeApi:
    files = ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
             "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
             "model.safetensors.index.json", "pytorch_model.bin", "original/consolidated.pth", "README.md",
             "chat_template.jinja"]

    def list_repo_files(self, repo_id, revision=None):
        if repo_id == "tiny-org/private":
            request = httpx.Request("GET", f"https://huggingface.co/api/models/{repo_id}")
            from huggingface_hub.errors import RepositoryNotFoundError

            raise RepositoryNotFoundError("Repository Not Found", response=httpx.Response(404, request=request))
        if repo_id == "tiny-org/unreachable":
            raise httpx.ConnectError("Name or service not known")
        return self.files


def test_online_downloads_what_the_loader_reads_into_the_cache(hub_cache, tiny, monkeypatch):
    """Offline off, not cached: the files to fetch are chosen (safetensors over .bin, top level
    only) and snapshot_download gets them; errors name the id. No network: both calls are stubs."""
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")
    calls = []

    def fake_snapshot_download(repo_id, *, revision=None, cache_dir=None, local_files_only=False,
                               allow_patterns=None):
        calls.append((repo_id, local_files_only, allow_patterns, cache_dir))
        if local_files_only:
            from huggingface_hub.errors import LocalEntryNotFoundError

            raise LocalEntryNotFoundError("not cached")
        return str(write_cache_entry(hub_cache, repo_id, tiny))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    folder = hub.resolve_model("tiny-org/fresh")
    assert (folder / "model.safetensors").is_file()
    assert [c[:2] for c in calls] == [("tiny-org/fresh", True), ("tiny-org/fresh", False)]
    assert sorted(calls[1][2]) == sorted(
        ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
         "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    )
    assert calls[1][3] == str(hub_cache)
    with pytest.raises(ModelLoadError, match=r"'tiny-org/private'.*no repository.*HF_TOKEN"):
        hub.resolve_model("tiny-org/private")
    with pytest.raises(ModelLoadError, match=r"'tiny-org/unreachable'.*downloading it failed: ConnectError"):
        hub.resolve_model("tiny-org/unreachable")


def test_bin_only_repositories_download_their_bin_files():
    files = ["config.json", "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin",
             "pytorch_model.bin.index.json", "training_args.bin", "sub/model.safetensors"]
    assert sorted(hub._files_to_download(files, need_weights=True)) == [
        "config.json", "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin",
        "pytorch_model.bin.index.json",
    ]
    assert hub._files_to_download(files, need_weights=False) == ["config.json"]
