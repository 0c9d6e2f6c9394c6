"""The recurrent drafter: a small RNN over the base model's embeddings plus
residual blocks that read ``[h ; s_t]`` and predict the next token.

Checkpoint format (the reference PyTorch trainer's, loaded as it is):
``config.json`` with ``vocab_size``, ``hidden_size``, ``exit_dim``,
``num_draft_layers``, ``rnn``; ``model.safetensors`` with

- ``input_proj.{weight,bias}``           only when ``exit_dim != 2 * hidden_size``
- ``lm_head.{i}.linear.{weight,bias}``   residual block i < num_draft_layers
- ``lm_head.{N}.weight``                 vocab projection, no bias
- ``rnn_u.{weight,bias}``, ``rnn_w.weight``  when ``rnn`` is true

Extension (this project): a reduced draft vocabulary. ``config.json`` then has
``draft_vocab_size`` and the safetensors file holds ``draft_token_ids``
(draft_vocab_size,), the base-model token id of each row of the vocab
projection; tokens outside it are never drafted. ``"sorted_draft_vocab":
true`` says the rows run from the most frequent token down (``train`` makes
them so); the beam search may then draft the tokens after the first from
the first rows only (``DraftSettings.later_vocab``).
"""

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import UserError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass
class DrafterArgs:
    vocab_size: int
    hidden_size: int
    exit_dim: int
    num_draft_layers: int = 1
    rnn: bool = True
    draft_vocab_size: Optional[int] = None
    sorted_draft_vocab: bool = False

    @classmethod
    def from_dict(cls, config: dict) -> "DrafterArgs":
        names = {f.name for f in fields(cls)}
        missing = [n for n in ("vocab_size", "hidden_size", "exit_dim") if n not in config]
        if missing:
            raise UserError(f"drafter config.json lacks {', '.join(missing)}")
        return cls(**{k: v for k, v in config.items() if k in names})

    def to_config(self) -> dict:
        """The ``config.json`` fields: the official layout's, plus the
        extension's where they are in use."""
        config = {k: v for k, v in asdict(self).items() if v is not None}
        if not config["sorted_draft_vocab"]:
            del config["sorted_draft_vocab"]
        return config


class ResBlock(nn.Module):
    """``x + silu(W x + b)``."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def __call__(self, x: mx.array) -> mx.array:
        return x + nn.silu(self.linear(x))


class Drafter(nn.Module):
    def __init__(self, args: DrafterArgs):
        super().__init__()
        self.args = args
        if args.exit_dim != 2 * args.hidden_size:
            self.input_proj = nn.Linear(2 * args.hidden_size, args.exit_dim)
        out_size = args.draft_vocab_size or args.vocab_size
        self.lm_head = [ResBlock(args.exit_dim) for _ in range(args.num_draft_layers)]
        self.lm_head.append(nn.Linear(args.exit_dim, out_size, bias=False))
        if args.rnn:
            self.rnn_u = nn.Linear(args.hidden_size, args.hidden_size)
            self.rnn_w = nn.Linear(args.hidden_size, args.hidden_size, bias=False)
        if args.draft_vocab_size:
            self.draft_token_ids = mx.zeros((args.draft_vocab_size,), mx.int32)
        self._halves = _InputHalves()

    @property
    def draft_vocab_size(self) -> int:
        return self.args.draft_vocab_size or self.args.vocab_size

    @property
    def sorted_draft_vocab(self) -> bool:
        """Whether the draft vocabulary's rows run from the most frequent token down."""
        return bool(self.args.draft_vocab_size) and self.args.sorted_draft_vocab

    def update_state(self, token_embeddings: mx.array, state: Optional[mx.array]) -> mx.array:
        """One RNN step. ``token_embeddings`` and ``state``: (..., hidden_size);
        ``state`` None stands for the zero initial state."""
        if not self.args.rnn:
            return token_embeddings if state is None else token_embeddings + state
        pre = self.rnn_w(token_embeddings)
        if state is not None:
            pre = pre + self.rnn_u(state)
        else:
            pre = pre + self.rnn_u.bias
        return nn.silu(pre)

    def features(self, hidden: mx.array, state: mx.array) -> mx.array:
        """What the vocab projection reads: (..., hidden_size) twice ->
        (..., exit_dim)."""
        x = mx.concatenate([hidden, state], axis=-1)
        if "input_proj" in self:
            x = self.input_proj(x)
        return self._trunk(x)

    def _trunk(self, x: mx.array) -> mx.array:
        """The head's layers before its vocab projection."""
        for layer in self.lm_head[:-1]:
            x = layer(x)
        return x

    def read_hidden(self, hidden: mx.array) -> mx.array:
        """What every depth of a search takes from h, worked out once:
        (..., hidden_size) -> (..., exit_dim), input_proj's product with h
        plus its bias (each depth then adds the product with its state, a
        projection half the size of input_proj); h itself where the
        drafter has no input_proj."""
        if "input_proj" not in self:
            return hidden
        return hidden @ self._halves.of(self.input_proj.weight, self.args.hidden_size)[0].T + self.input_proj.bias

    def search_log_probs(self, read: mx.array, state: mx.array, rows: Optional[int] = None) -> mx.array:
        """``log_probs`` from ``read_hidden(hidden)``, (..., exit_dim or
        hidden_size) and ``state`` (..., hidden_size)."""
        if "input_proj" in self:
            x = read + state @ self._halves.of(self.input_proj.weight, self.args.hidden_size)[1].T
        else:
            x = mx.concatenate([read, state], axis=-1)
        return self._normalised(self._project(self._trunk(x), rows))

    def _project(self, features: mx.array, rows: Optional[int]) -> mx.array:
        projection = self.lm_head[-1]
        if rows is None or rows >= self.draft_vocab_size:
            return projection(features)
        return features @ projection.weight[:rows].T

    @staticmethod
    def _normalised(logits: mx.array) -> mx.array:
        logits = logits.astype(mx.float32)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def draft_logits(self, hidden: mx.array, state: mx.array, rows: Optional[int] = None) -> mx.array:
        """Logits over the draft vocabulary. ``hidden``, ``state``:
        (..., hidden_size) -> (..., draft_vocab_size or vocab_size), or over
        its first ``rows`` entries only: (..., rows)."""
        return self._project(self.features(hidden, state), rows)

    def log_probs(self, hidden: mx.array, state: mx.array, rows: Optional[int] = None) -> mx.array:
        """Log-probabilities over the draft vocabulary, (..., draft_vocab), in
        float32, or over its first ``rows`` entries, normalised over them.
        Map indices to token ids with ``token_ids``."""
        return self._normalised(self.draft_logits(hidden, state, rows))

    def token_ids(self, draft_indices: mx.array) -> mx.array:
        """Base-model token ids of draft-vocabulary indices (same shape)."""
        if not self.args.draft_vocab_size:
            return draft_indices
        return self.draft_token_ids[draft_indices]


class _InputHalves:
    """input_proj's weight (exit_dim, 2 * hidden_size) split into its h and
    state halves, each contiguous (a product with a slice of the weight
    would copy the slice every time), split again whenever the weight is
    another array (loaded, trained, cast)."""

    def __init__(self):
        self.weight = self.halves = None

    def of(self, weight: mx.array, hidden_size: int) -> tuple[mx.array, mx.array]:
        if self.weight is not weight:
            self.weight = weight
            self.halves = mx.contiguous(weight[:, :hidden_size]), mx.contiguous(weight[:, hidden_size:])
        return self.halves


def check_compatible(args: DrafterArgs, hidden_size: int, vocab_size: int) -> None:
    """Refuse a drafter made for another base model."""
    if args.hidden_size != hidden_size:
        raise UserError(
            f"drafter hidden_size {args.hidden_size} does not match the base model's hidden size {hidden_size}"
        )
    if args.vocab_size != vocab_size:
        raise UserError(
            f"drafter vocab_size {args.vocab_size} does not match the base model's vocabulary size {vocab_size}"
        )


def read_config(path: Path) -> dict:
    """A drafter's config.json as a dict, or one clear error."""
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} must hold a JSON object")
    return config


def load_drafter(path: str, dtype: Optional[mx.Dtype] = None) -> Drafter:
    """Load a drafter folder (``config.json`` + ``model.safetensors``)."""
    folder = Path(path)
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not folder.is_dir():
        raise UserError(f"drafter folder not found: {path}")
    if not config_path.is_file() or not weights_path.is_file():
        raise UserError(f"drafter folder {path} needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    config = read_config(config_path)
    drafter = Drafter(DrafterArgs.from_dict(config))
    quantization = config.get("quantization")
    if quantization:  # only the vocab projection is ever quantized
        drafter.lm_head[-1] = nn.QuantizedLinear.from_linear(
            drafter.lm_head[-1], group_size=quantization["group_size"], bits=quantization["bits"]
        )
    try:
        weights = mx.load(str(weights_path))
    except Exception as e:  # mlx raises plain RuntimeError/ValueError on a bad file
        raise UserError(f"cannot read drafter weights {weights_path}: {e}") from None
    try:
        drafter.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise UserError(f"drafter weights {weights_path} do not match its config: {e}") from None
    if "draft_token_ids" in weights and not mx.issubdtype(weights["draft_token_ids"].dtype, mx.integer):
        raise UserError(f"drafter weights {weights_path}: draft_token_ids must be integers")
    if dtype is not None:
        drafter.set_dtype(dtype)
    mx.eval(drafter.parameters())
    drafter.eval()
    return drafter


def save_drafter(drafter: Drafter, path: str, extra_config: Optional[dict] = None) -> None:
    """Write the drafter in the official layout (plus the reduced-vocab extension)."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    config = drafter.args.to_config()
    config.update(extra_config or {})
    mx.save_safetensors(str(folder / WEIGHTS_FILE), dict(tree_flatten(drafter.parameters())))
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
