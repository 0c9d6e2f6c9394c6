"""Converting PyTorch-trained drafter checkpoints into the MLX drafter format."""

import json
import sys

import mlx.core as mx
import numpy as np
import pytest

import redrafter_mlx  # noqa: F401  (before mlx.core)
from conftest import tiny_model
from redrafter_mlx.convert import convert_checkpoint
from redrafter_mlx.drafting.drafter import load_drafter
from redrafter_mlx.errors import UserError

torch = pytest.importorskip("torch")
F = torch.nn.functional
from safetensors.torch import save_file  # noqa: E402

HIDDEN, VOCAB = 16, 40
ARCHITECTURES = [  # exit_dim, residual blocks, rnn
    (32, 1, True),  # exit_dim == 2 * hidden: no input_proj
    (24, 2, True),  # input_proj
    (32, 0, False),
    (48, 3, False),
]


class TorchResBlock(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.linear = torch.nn.Linear(dim, dim)

    def forward(self, x):
        return x + F.silu(self.linear(x))


class TorchDrafter(torch.nn.Module):
    """The drafter as the reference trainer specifies it."""

    def __init__(self, vocab, hidden, exit_dim, layers, rnn):
        super().__init__()
        self.rnn = rnn
        if exit_dim != 2 * hidden:
            self.input_proj = torch.nn.Linear(2 * hidden, exit_dim)
        self.lm_head = torch.nn.Sequential(
            *[TorchResBlock(exit_dim) for _ in range(layers)], torch.nn.Linear(exit_dim, vocab, bias=False)
        )
        if rnn:
            self.rnn_u = torch.nn.Linear(hidden, hidden)
            self.rnn_w = torch.nn.Linear(hidden, hidden, bias=False)

    @torch.no_grad()
    def forward(self, hidden, embeddings):
        """hidden (H,), embeddings (T, H) -> logits (T, vocab), one per RNN step."""
        state, out = torch.zeros_like(hidden), []
        for e in embeddings:
            state = F.silu(self.rnn_w(e) + self.rnn_u(state)) if self.rnn else e + state
            x = torch.cat([hidden, state])
            if hasattr(self, "input_proj"):
                x = self.input_proj(x)
            out.append(self.lm_head(x))
        return torch.stack(out)


class NotATensor:
    """A custom class: a pickle holding one needs arbitrary code to load."""


def make_drafter(exit_dim, layers, rnn, hidden=HIDDEN, vocab=VOCAB, seed=0):
    torch.manual_seed(seed)
    module = TorchDrafter(vocab, hidden, exit_dim, layers, rnn)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    config = dict(vocab_size=vocab, hidden_size=hidden, exit_dim=exit_dim, num_draft_layers=layers, rnn=rnn)
    return module, config


def write_folder(folder, module, config, kind):
    folder.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in module.state_dict().items()}
    if kind == "bin":
        torch.save(state, folder / "pytorch_model.bin")
    else:
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    reference_config = dict(config, num_lookback_tokens=1, architectures=["ReDrafter"], torch_dtype="float32")
    (folder / "config.json").write_text(json.dumps(reference_config))
    return folder


def inputs(hidden=HIDDEN, steps=4, seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=hidden).astype(np.float32), rng.normal(size=(steps, hidden)).astype(np.float32)


def mlx_logits(drafter, hidden, embeddings):
    state, out = None, []
    for e in embeddings:
        state = drafter.update_state(mx.array(e)[None], state)
        out.append(np.array(drafter.draft_logits(mx.array(hidden)[None], state).astype(mx.float32))[0])
    return np.array(out)


def torch_logits(module, hidden, embeddings):
    return module(torch.from_numpy(hidden), torch.from_numpy(embeddings)).numpy()


def max_diff(module, drafter, hidden=HIDDEN):
    h, e = inputs(hidden)
    return np.abs(mlx_logits(drafter, h, e) - torch_logits(module, h, e)).max()


def leftovers(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("exit_dim, layers, rnn", ARCHITECTURES)
@pytest.mark.parametrize("form", ["bin-folder", "safetensors-folder", "pt-with-config", "pt-inferred"])
def test_converted_drafter_computes_like_torch(tmp_path, form, exit_dim, layers, rnn):
    module, config = make_drafter(exit_dim, layers, rnn)
    given = None
    if form.endswith("folder"):
        source = write_folder(tmp_path / "ckpt", module, config, form.split("-")[0])
    else:
        source = tmp_path / "drafter.pt"
        torch.save(module.state_dict(), source)
        given = config if form == "pt-with-config" else None
    summary = convert_checkpoint(str(source), str(tmp_path / "mlx"), dtype="float32", config=given)

    assert summary["config"] == config
    assert summary["tensors"] == len(module.state_dict())
    assert summary["bytes"] == sum(p.stat().st_size for p in (tmp_path / "mlx").iterdir())
    if form == "pt-inferred":
        assert set(summary["inferred"]) == set(config)
        assert any("inferred" in note for note in summary["notes"])
    else:
        assert summary["inferred"] == {}
    assert max_diff(module, load_drafter(str(tmp_path / "mlx"))) <= 1e-5


def test_partial_config_is_completed_from_shapes(tmp_path):
    module, config = make_drafter(24, 2, True)
    torch.save(module.state_dict(), tmp_path / "d.pt")
    summary = convert_checkpoint(
        str(tmp_path / "d.pt"), str(tmp_path / "out"), "float32", config={"vocab_size": VOCAB, "rnn": True}
    )
    assert summary["config"] == config
    assert summary["inferred"] == {"hidden_size": HIDDEN, "exit_dim": 24, "num_draft_layers": 2}


def renamed_variants(state):
    """The same weights as other trainers name them."""

    def rename(prefix, mapping):
        out = {}
        for name, value in state.items():
            for old, new in mapping:
                if name.startswith(old):
                    name = new + name[len(old) :]
                    break
            out[prefix + name] = value
        return out

    plural = rename("module.drafter.", [("lm_head.", "lm_heads."), ("input_proj.", "input_projs.")])
    # TensorRT-LLM: blocks under layers.i, the vocab projection as lm_head.weight,
    # next to the base model's own tensors.
    trt = {}
    for name, value in state.items():
        if ".linear." in name:
            name = "layers." + name[len("lm_head.") :]
        elif name == "lm_head.2.weight":
            name = "lm_head.weight"
        trt["drafter." + name] = value
    trt["llm.model.embed_tokens.weight"] = torch.zeros(VOCAB, HIDDEN)
    # Blocks without the inner .linear, nested in a training-script checkpoint
    # of a torch.compile'd module.
    flat = {"_orig_mod." + name.replace(".linear.", "."): value for name, value in state.items()}
    nested = {"state_dict": flat, "epoch": 3, "step": 1000}
    return {"plural-ddp": plural, "tensorrt-llm": trt, "nested-flat": nested}


@pytest.mark.parametrize("variant", ["plural-ddp", "tensorrt-llm", "nested-flat"])
def test_renamed_variants_map_to_official_names(tmp_path, variant):
    module, config = make_drafter(24, 2, True)
    checkpoint = renamed_variants(module.state_dict())[variant]
    torch.save(checkpoint, tmp_path / "d.bin")
    summary = convert_checkpoint(str(tmp_path / "d.bin"), str(tmp_path / "out"), "float32", config=config)
    assert any("renamed" in note for note in summary["notes"])
    if variant == "nested-flat":
        assert any("under 'state_dict'" in note and "'epoch'" in note for note in summary["notes"])
    assert max_diff(module, load_drafter(str(tmp_path / "out"))) <= 1e-5


@pytest.mark.parametrize(
    "source_dtype, suffix",
    [
        (torch.bfloat16, ".safetensors"),
        (torch.bfloat16, ".pt"),
        (torch.float64, ".safetensors"),
        (torch.float16, ".bin"),
    ],
)
def test_source_precisions(tmp_path, source_dtype, suffix):
    module, config = make_drafter(24, 2, True)
    module.to(source_dtype)
    state = {k: v.contiguous() for k, v in module.state_dict().items()}
    path = tmp_path / f"d{suffix}"
    if suffix == ".safetensors":
        save_file(state, str(path))
    else:
        torch.save(state, path)
    convert_checkpoint(str(path), str(tmp_path / "out"), "float32", config=config)
    module.to(torch.float32)  # the stored values, exactly
    assert max_diff(module, load_drafter(str(tmp_path / "out"))) <= 1e-5


@pytest.mark.parametrize("kind", ["safetensors", "bin"])
def test_sharded_checkpoint_with_index(tmp_path, kind):
    module, config = make_drafter(24, 2, True)
    state = module.state_dict()
    names = list(state)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :]), start=1):
        if kind == "safetensors":
            shard = f"model-{i:05d}-of-00002.safetensors"
            save_file({n: state[n].contiguous() for n in part}, str(folder / shard))
        else:
            shard = f"pytorch_model-{i:05d}-of-00002.bin"
            torch.save({n: state[n] for n in part}, folder / shard)
        weight_map.update({n: shard for n in part})
    index = "model.safetensors.index.json" if kind == "safetensors" else "pytorch_model.bin.index.json"
    (folder / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config))
    summary = convert_checkpoint(str(folder), str(tmp_path / "out"), "float32")
    assert len(summary["source_files"]) == 2
    assert max_diff(module, load_drafter(str(tmp_path / "out"))) <= 1e-5


def test_reduced_vocabulary_checkpoint(tmp_path):
    module, config = make_drafter(32, 1, True, vocab=24)
    state = dict(module.state_dict(), draft_token_ids=torch.arange(100, 124, dtype=torch.int64))
    torch.save(state, tmp_path / "d.pt")
    with pytest.raises(UserError, match="lacks vocab_size"):
        convert_checkpoint(str(tmp_path / "d.pt"), str(tmp_path / "out"), "float32")
    summary = convert_checkpoint(str(tmp_path / "d.pt"), str(tmp_path / "out"), "float32", config={"vocab_size": 200})
    assert summary["config"]["draft_vocab_size"] == 24
    drafter = load_drafter(str(tmp_path / "out"))
    assert max_diff(module, drafter) <= 1e-5
    assert drafter.token_ids(mx.array([0, 23])).tolist() == [100, 123]


@pytest.mark.parametrize("dtype, mx_dtype", [("float16", mx.float16), ("bfloat16", mx.bfloat16)])
def test_half_precision_output(tmp_path, dtype, mx_dtype):
    module, config = make_drafter(24, 2, True)
    source = write_folder(tmp_path / "ckpt", module, config, "safetensors")
    convert_checkpoint(str(source), str(tmp_path / "out"), dtype=dtype)
    stored = mx.load(str(tmp_path / "out" / "model.safetensors"))
    assert {v.dtype for v in stored.values()} == {mx_dtype}
    h, e = inputs()
    reference = torch_logits(module, h, e)
    got = mlx_logits(load_drafter(str(tmp_path / "out"), dtype=mx.float32), h, e)
    assert np.abs(got - reference).max() <= 0.02 * np.abs(reference).max()


@pytest.mark.parametrize("bits, tolerance", [(8, 0.02), (4, 0.2)])
def test_quantized_vocab_projection(tmp_path, bits, tolerance):
    module, config = make_drafter(64, 1, True, vocab=96)
    source = write_folder(tmp_path / "ckpt", module, config, "bin")
    summary = convert_checkpoint(str(source), str(tmp_path / "out"), dtype="float32", quantize_bits=bits)
    assert summary["config"]["quantization"] == {"group_size": 64, "bits": bits}
    stored = mx.load(str(tmp_path / "out" / "model.safetensors"))
    assert stored["lm_head.1.weight"].dtype == mx.uint32
    assert stored["lm_head.1.weight"].shape == (96, 64 * bits // 32)
    assert stored["lm_head.1.scales"].shape == stored["lm_head.1.biases"].shape == (96, 1)
    drafter = load_drafter(str(tmp_path / "out"))
    h, e = inputs()
    got = mlx_logits(drafter, h, e)
    # Exact against torch with the dequantized vocab projection ...
    dequantized = mx.dequantize(
        stored["lm_head.1.weight"], stored["lm_head.1.scales"], stored["lm_head.1.biases"], group_size=64, bits=bits
    )
    with torch.no_grad():
        original = module.lm_head[1].weight.clone()
        module.lm_head[1].weight.copy_(torch.from_numpy(np.array(dequantized)))
        assert np.abs(got - torch_logits(module, h, e)).max() <= 1e-4
        module.lm_head[1].weight.copy_(original)
    # ... and close to the unquantized drafter.
    reference = torch_logits(module, h, e)
    assert np.abs(got - reference).max() <= tolerance * np.abs(reference).max()


def test_checkpoint_without_torch_reads_safetensors_only(tmp_path, monkeypatch):
    module, config = make_drafter(24, 2, True)
    write_folder(tmp_path / "st", module, config, "safetensors")
    write_folder(tmp_path / "bin", module, config, "bin")
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now fails
    convert_checkpoint(str(tmp_path / "st"), str(tmp_path / "out-st"), "float32")
    with pytest.raises(UserError, match="pip install torch"):
        convert_checkpoint(str(tmp_path / "bin"), str(tmp_path / "out-bin"), "float32")
    assert not (tmp_path / "out-bin").exists()


def test_base_model_is_checked(tmp_path, monkeypatch):
    from redrafter_mlx.loading import loader as loading

    monkeypatch.setattr(loading, "load_base_model", lambda path, dtype=None, quantize=None: (tiny_model(), None))
    module, config = make_drafter(128, 1, True, hidden=64, vocab=256)
    torch.save(module.state_dict(), tmp_path / "good.pt")
    convert_checkpoint(str(tmp_path / "good.pt"), str(tmp_path / "out"), "float32", base_model="tiny")
    assert max_diff(module, load_drafter(str(tmp_path / "out")), hidden=64) <= 1e-5

    module, config = make_drafter(32, 1, True)
    source = write_folder(tmp_path / "small", module, config, "bin")
    before = leftovers(tmp_path)
    with pytest.raises(UserError, match="hidden_size 16 does not match the base model's hidden size 64"):
        convert_checkpoint(str(source), str(tmp_path / "new" / "out"), "float32", base_model="tiny")
    assert leftovers(tmp_path) == before


def bad_checkpoints(tmp_path):
    """(name, checkpoint path, config, error pattern) for each kind of bad input."""
    module, config = make_drafter(32, 1, True)
    state = module.state_dict()
    cases = []

    def pt(name, content):
        torch.save(content, tmp_path / f"{name}.pt")
        return str(tmp_path / f"{name}.pt")

    cases.append(
        (
            "missing",
            pt("missing", {k: v for k, v in state.items() if k != "rnn_w.weight"}),
            config,
            r"missing tensors: rnn_w\.weight \(16, 16\)",
        )
    )
    cases.append(
        (
            "extra",
            pt("extra", dict(state, **{"module.lm_head.0.linear.scale": torch.ones(32)})),
            config,
            r"unexpected tensors: 'lm_head\.0\.linear\.scale' \(named 'module\.lm_head\.0\.linear\.scale'",
        )
    )
    cases.append(
        (
            "wrong-shape",
            pt("shape", state),
            dict(config, vocab_size=50),
            r"'lm_head\.1\.weight' has shape \(40, 32\), expected \(50, 32\) from vocab_size=50, exit_dim=32",
        )
    )
    cases.append(
        (
            "input-proj-mismatch",
            pt("proj", state),
            dict(config, exit_dim=48),
            r"missing tensors: input_proj\.weight \(48, 32\)",
        )
    )
    cases.append(
        (
            "custom-class",
            pt("evil", dict(state, extra=NotATensor())),
            config,
            r"needs arbitrary code to load \(it refers to .*NotATensor\); it will not be loaded",
        )
    )
    cases.append(("whole-module", pt("module", module), config, "needs arbitrary code"))
    (tmp_path / "garbage.pt").write_bytes(b"\x80not a pickle" * 20)
    cases.append(("corrupt-pickle", str(tmp_path / "garbage.pt"), config, "cannot read .*garbage.pt"))
    (tmp_path / "garbage.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken json}...")
    cases.append(
        (
            "corrupt-safetensors",
            str(tmp_path / "garbage.safetensors"),
            config,
            "cannot read .*not a valid safetensors file",
        )
    )
    cases.append(("missing-path", str(tmp_path / "nowhere"), config, "checkpoint not found"))
    cases.append(("not-a-state-dict", pt("list", [1, 2, 3]), config, "does not hold a state dict"))
    cases.append(
        (
            "nan",
            pt("nan", dict(state, **{"rnn_u.bias": torch.full((16,), float("nan"))})),
            config,
            r"'rnn_u\.bias' holds NaN",
        )
    )
    empty = tmp_path / "empty-folder"
    empty.mkdir()
    cases.append(("folder-without-weights", str(empty), config, "no weights in"))
    return cases


def test_bad_input_is_refused_and_leaves_nothing(tmp_path):
    cases = bad_checkpoints(tmp_path)
    before = leftovers(tmp_path)
    for name, source, config, pattern in cases:
        with pytest.raises(UserError, match=pattern):
            convert_checkpoint(source, str(tmp_path / "out" / name), "float32", config=config)
        assert leftovers(tmp_path) == before, name


def test_bad_options_and_occupied_destination(tmp_path, monkeypatch):
    module, config = make_drafter(32, 1, True)
    source = write_folder(tmp_path / "ckpt", module, config, "safetensors")
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    before = leftovers(tmp_path)
    for kwargs, pattern in [
        (dict(mlx_path=str(occupied)), "exists and is not empty"),
        (dict(mlx_path=str(occupied / "keep.txt")), "exists and is not a folder"),
        (dict(mlx_path=str(tmp_path / "o"), dtype="float8"), "unknown dtype"),
        (dict(mlx_path=str(tmp_path / "o"), quantize_bits=3), "4 or 8 bits"),
        (
            dict(mlx_path=str(tmp_path / "o"), quantize_bits=4),
            "exit_dim divisible by the group size 64, got exit_dim=32",
        ),
        (dict(mlx_path=str(tmp_path / "o"), config={"rnn": "yes"}), "rnn must be true or false"),
    ]:
        with pytest.raises(UserError, match=pattern):
            convert_checkpoint(str(source), **kwargs)
        assert leftovers(tmp_path) == before
    assert (occupied / "keep.txt").read_text() == "mine"

    torch.save(dict(module.state_dict(), **{"rnn_u.bias": torch.full((16,), 1e6)}), tmp_path / "big.pt")
    before = leftovers(tmp_path)
    with pytest.raises(UserError, match="'rnn_u.bias' overflows float16"):
        convert_checkpoint(str(tmp_path / "big.pt"), str(tmp_path / "o"), "float16", config=config)
    assert leftovers(tmp_path) == before

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mx, "save_safetensors", fail)
    with pytest.raises(UserError, match="cannot write .*disk is full"):
        convert_checkpoint(str(source), str(tmp_path / "deep" / "er" / "out"), "float32")
    assert leftovers(tmp_path) == before
    monkeypatch.undo()

    empty = tmp_path / "empty"
    empty.mkdir()  # an existing empty folder is filled
    convert_checkpoint(str(source), str(empty), "float32")
    assert max_diff(module, load_drafter(str(empty))) <= 1e-5
