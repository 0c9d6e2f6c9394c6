"""Loading a base model from an mlx-lm / Hugging Face folder, with its drafter."""

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from redrafter_mlx import DraftSettings, generate, load
from redrafter_mlx.drafting.drafter import Drafter, DrafterArgs, save_drafter
from redrafter_mlx.errors import UserError
from redrafter_mlx.loading.loader import load_base_model


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A tiny Llama in mlx-lm's folder layout, with SmolLM2's tokenizer."""
    folder = tmp_path_factory.mktemp("models") / "tiny-llama"
    folder.mkdir()
    _, tokenizer = load_base_model(None)
    tokenizer._tokenizer.save_pretrained(str(folder))
    config = dict(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=49152,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
    )
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(**config))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_folder_model_loads_and_generates(model_folder, tmp_path):
    save_drafter(Drafter(DrafterArgs(vocab_size=49152, hidden_size=64, exit_dim=32)), str(tmp_path / "d"))
    redrafter, tokenizer = load(str(model_folder), drafter=str(tmp_path / "d"))
    assert redrafter.base.hidden_size == 64 and redrafter.base.max_context == 2048
    text = generate(redrafter, tokenizer, "Hello", max_tokens=8, draft=DraftSettings(beam_width=2, beam_length=3))
    assert isinstance(text, str)


def test_a_loaded_model_generates_on_another_thread(model_folder, tmp_path):
    """MLX runs a lazy graph only on the thread that built it; the server
    loads on one thread and decodes on another. A float16 drafter is cast
    to the float32 base model's dtype on loading: that cast must be done."""
    import threading

    drafter = Drafter(DrafterArgs(vocab_size=49152, hidden_size=64, exit_dim=32))
    drafter.set_dtype(mx.float16)
    save_drafter(drafter, str(tmp_path / "d16"))
    redrafter, tokenizer = load(str(model_folder), drafter=str(tmp_path / "d16"))
    results = []
    worker = threading.Thread(
        target=lambda: results.append(
            generate(redrafter, tokenizer, "Hello", max_tokens=8, draft=DraftSettings(max_nodes=4))
        )
    )
    worker.start()
    worker.join()
    assert len(results) == 1 and isinstance(results[0], str)


def test_missing_model_and_bad_dtype(tmp_path):
    with pytest.raises(UserError, match="model not found"):
        load_base_model(str(tmp_path / "nothing"))
    with pytest.raises(UserError, match="unknown dtype"):
        load_base_model(None, dtype="float8")


def test_a_model_folder_with_a_broken_json_file_names_the_file(model_folder, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(model_folder, broken)
    (broken / "config.json").write_text('{"model_type": "llama",\n  "hidden_size": 64,,}')
    with pytest.raises(UserError, match=r"config.json is not valid JSON \(line 2, column 21: "):
        load_base_model(str(broken))


# -- drafters from the Hugging Face Hub, read offline from a prepared cache

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root, repo_id: str, drafter_folder=None):
    """A Hugging Face hub cache under ``root`` holding ``drafter_folder``'s
    files as the latest snapshot of ``repo_id`` (``refs/main`` naming the
    commit whose ``snapshots/`` folder holds them), as ``snapshot_download``
    reads it offline; only the empty cache without ``drafter_folder``."""
    import shutil

    root.mkdir(parents=True, exist_ok=True)
    if drafter_folder is not None:
        repo = root / ("models--" + repo_id.replace("/", "--"))
        shutil.copytree(drafter_folder, repo / "snapshots" / COMMIT)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(COMMIT)  # no newline: the file is read as it is
    return root


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty hub cache, offline. huggingface_hub reads HF_HUB_CACHE and
    HF_HUB_OFFLINE when it is imported (mlx-lm imports it before any test),
    so its constants are set too; processes started from here read the
    environment."""
    from huggingface_hub import constants

    cache = hub_cache(tmp_path / "hf-cache", "unused/unused")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def random_drafter(folder, seed: int) -> str:
    mx.random.seed(seed)
    save_drafter(Drafter(DrafterArgs(vocab_size=49152, hidden_size=64, exit_dim=32)), str(folder))
    return str(folder)


def test_a_drafter_given_by_hub_id_loads_from_the_hugging_face_cache(model_folder, tmp_path, offline_hub, monkeypatch):
    from redrafter_mlx.drafting.drafter import load_drafter
    from redrafter_mlx.loading.loader import drafter_identity

    saved = random_drafter(tmp_path / "saved", seed=3)
    hub_cache(offline_hub, "org/name", saved)
    redrafter, tokenizer = load(str(model_folder), drafter="org/name")
    assert redrafter.drafter_identity == drafter_identity(saved)
    expected = dict(tree_flatten(load_drafter(saved).parameters()))
    for name, value in tree_flatten(redrafter.drafter.parameters()):
        assert mx.array_equal(value, expected[name]), name
    assert isinstance(generate(redrafter, tokenizer, "Hello", max_tokens=4, draft=DraftSettings(max_nodes=4)), str)

    # A local folder of the same name wins over the Hub.
    monkeypatch.chdir(tmp_path)
    local = random_drafter(tmp_path / "org" / "name", seed=4)
    assert (
        load(str(model_folder), drafter="org/name")[0].drafter_identity
        == drafter_identity(local)
        != drafter_identity(saved)
    )


def test_a_hub_drafter_that_cannot_be_had_is_one_clear_error(model_folder, tmp_path, offline_hub):
    def error(drafter):
        with pytest.raises(UserError) as caught:
            load(str(model_folder), drafter=drafter)
        assert "\n" not in str(caught.value)
        return str(caught.value)

    message = error("org/absent")
    assert message.startswith(
        "drafter org/absent is not in the local Hugging Face cache and the Hub cannot be reached (offline"
    )
    (tmp_path / "card-only").mkdir()
    (tmp_path / "card-only" / "README.md").write_text("# not a drafter\n")
    hub_cache(offline_hub, "org/card-only", tmp_path / "card-only")
    assert (
        error("org/card-only")
        == "Hugging Face repository org/card-only is not a drafter: it has no config.json or model.safetensors"
    )
    # Local paths (., /, ~, or not exactly one "/") are never looked up on the Hub.
    for path in ("./org/absent", str(tmp_path / "absent"), "a/b/c", "absent"):
        assert error(path) == f"drafter folder not found: {path}"


def test_generate_takes_a_hub_drafter_from_the_command_line(model_folder, tmp_path):
    """Through the command line, whose process reads the cache and offline
    mode from the environment: the cached drafter generates; an empty cache
    is one error line naming the id, exit status 1."""
    from conftest import run_cli

    cache = hub_cache(tmp_path / "hf-cache", "org/name", random_drafter(tmp_path / "saved", seed=3))
    offline = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    args = ("generate", "--model", model_folder, "--prompt", "Hello", "--max-tokens", 4, "--json")
    result = run_cli(*args, "--drafter", "org/name", env=offline)
    assert result.returncode == 0 and json.loads(result.stdout)["generation_tokens"] >= 1, result.stderr
    result = run_cli(*args, "--drafter", "org/missing", env=offline)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith(
        "error: drafter org/missing is not in the local Hugging Face cache and the Hub cannot be reached (offline"
    )


def test_a_drafter_made_for_another_model_of_the_same_sizes_is_loaded_with_a_warning(model_folder, tmp_path, capsys):
    save_drafter(
        Drafter(DrafterArgs(vocab_size=49152, hidden_size=64, exit_dim=32)),
        str(tmp_path / "d"),
        {"base_model": {"name": "another-model", "identity": "0123456789abcdef"}},
    )
    redrafter, _ = load(str(model_folder), drafter=str(tmp_path / "d"))
    err = capsys.readouterr().err
    assert redrafter.drafter is not None
    assert f"warning: drafter {tmp_path / 'd'} was made for another-model (identity 0123456789abcdef)" in err
