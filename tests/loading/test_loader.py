"""Loading a base model from an mlx-lm / Hugging Face folder, with its drafter."""

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from redrafter_mlx import generate
from redrafter_mlx import load
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
    config = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048)
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(**config))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_folder_model_loads_and_generates(model_folder, tmp_path):
    save_drafter(Drafter(DrafterArgs(vocab_size=49152, hidden_size=64, exit_dim=32)), str(tmp_path / "d"))
    redrafter, tokenizer = load(str(model_folder), str(tmp_path / "d"))
    assert redrafter.base.hidden_size == 64 and redrafter.base.max_context == 2048
    text = generate(redrafter, tokenizer, "Hello", max_tokens=8, beam_width=2, beam_length=3)
    assert isinstance(text, str)


def test_a_loaded_model_generates_on_another_thread(model_folder, tmp_path):
    """MLX runs a lazy graph only on the thread that built it; the server
    loads on one thread and decodes on another. A float16 drafter is cast
    to the float32 base model's dtype on loading: that cast must be done."""
    import threading

    drafter = Drafter(DrafterArgs(vocab_size=49152, hidden_size=64, exit_dim=32))
    drafter.set_dtype(mx.float16)
    save_drafter(drafter, str(tmp_path / "d16"))
    redrafter, tokenizer = load(str(model_folder), str(tmp_path / "d16"))
    results = []
    worker = threading.Thread(target=lambda: results.append(generate(redrafter, tokenizer, "Hello", max_tokens=8, max_nodes=4)))
    worker.start()
    worker.join()
    assert len(results) == 1 and isinstance(results[0], str)


def test_missing_model_and_bad_dtype(tmp_path):
    with pytest.raises(UserError, match="model not found"):
        load_base_model(str(tmp_path / "nothing"))
    with pytest.raises(UserError, match="unknown dtype"):
        load_base_model(None, dtype="float8")
