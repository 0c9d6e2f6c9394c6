"""Tiny random models and drafters shared by the tests."""

import itertools
import os
import tempfile
from dataclasses import fields

import redrafter_mlx  # noqa: F401  (preloads OpenBLAS before mlx.core)

# Cost curves measured by the tests go to a folder of their own, also for
# the command-line processes they start.
os.environ.setdefault("REDRAFTER_MLX_CACHE", tempfile.mkdtemp(prefix="redrafter-cost-"))

import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import gemma3_text, lfm2, llama, mixtral, nemotron_h, qwen2, qwen3_5, qwen3_moe, qwen3_next

from redrafter_mlx.drafting.cost import CostCurve
from redrafter_mlx.drafting.drafter import Drafter, DrafterArgs
from redrafter_mlx.drafting.settings import DraftSettings
from redrafter_mlx.engine import calibrate, costs
from redrafter_mlx.engine.base_model import BaseModel
from redrafter_mlx.engine.decoder import generate_steps
from redrafter_mlx.engine.types import ReDrafter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout
VOCAB = 256
HIDDEN = 64


# The relative cost of N new tokens measured on a 2-core CPU (the default
# model after 200 tokens): in-process tests size their trees by it, so what
# they verify does not depend on the machine that runs them. test_cost
# measures real curves; command-line tests, in their own processes, too.
CPU_CURVE = CostCurve(
    [1, 2, 3, 4, 6, 8, 12, 16, 32], [1.0, 1.10, 1.24, 1.33, 1.41, 1.46, 2.0, 2.0, 2.9], draft_seconds=0.1
)


@pytest.fixture(scope="session", autouse=True)
def launched_processes_without_torch():
    """The processes the tests launch, and those the bench scripts they call
    launch, import from this checkout and a sitecustomize that hides torch
    from them (tests/without_torch). Set in each test process, not at
    import: the processes xdist starts to run the tests need torch."""
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "without_torch")])
    yield
    if previous is None:
        del os.environ["PYTHONPATH"]
    else:
        os.environ["PYTHONPATH"] = previous


@pytest.fixture(autouse=True)
def fixed_cost_curve(monkeypatch):
    """Every curve is CPU_CURVE, and steps do not correct it (their real
    seconds would make what tests verify depend on the machine)."""
    monkeypatch.setattr(calibrate, "cost_curve", lambda *args, **kwargs: CPU_CURVE)
    monkeypatch.setattr(costs, "learning", lambda redrafter: False)


def tiny_model(kind: str = "llama", seed: int = 0, quantize: bool = False, vocab: int = VOCAB) -> nn.Module:
    """A randomly initialised float32 mlx-lm model."""
    mx.random.seed(seed)
    common = dict(
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        max_position_embeddings=4096,
    )
    if kind == "llama":
        model = llama.Model(llama.ModelArgs(model_type="llama", tie_word_embeddings=False, **common))
    elif kind == "qwen2":
        model = qwen2.Model(qwen2.ModelArgs(model_type="qwen2", tie_word_embeddings=True, **common))
    elif kind == "gemma3":
        args = dict(common, num_hidden_layers=3, head_dim=16)
        model = gemma3_text.Model(
            gemma3_text.ModelArgs(model_type="gemma3_text", sliding_window=8, sliding_window_pattern=3, **args)
        )
    elif kind in HYBRIDS or kind in EXPERTS:
        model = tiny_hybrid(kind, common)
    else:
        raise ValueError(kind)
    if quantize:
        nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


HYBRIDS = ["qwen3_next", "qwen3_5", "nemotron_h", "lfm2"]  # layers with recurrent or convolutional state
EXPERTS = ["qwen3_moe", "mixtral"]  # mixtures of experts


def tiny_hybrid(kind: str, common: dict) -> nn.Module:
    """The hybrid and expert architectures, each with both kinds of layer
    (4 layers at most, hidden size 64)."""
    linear = dict(
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        head_dim=16,
        full_attention_interval=2,
    )
    experts = dict(
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=32
    )
    if kind == "qwen3_next":  # Gated DeltaNet and attention, experts with a shared one
        args = dict(common, num_hidden_layers=4, **linear, **experts)
        return qwen3_next.Model(
            qwen3_next.ModelArgs(
                model_type=kind,
                shared_expert_intermediate_size=64,
                rope_theta=10000.0,
                partial_rotary_factor=0.5,
                **args,
            )
        )
    if kind == "qwen3_5":  # Gated DeltaNet and attention, inside a multimodal wrapper
        text = dict(common, model_type="qwen3_5_text", num_hidden_layers=4, **linear)
        return qwen3_5.Model(qwen3_5.ModelArgs(model_type=kind, text_config=text))
    if kind == "nemotron_h":  # Mamba2, attention without positions, MLP-only layers
        args = {k: v for k, v in common.items() if k not in ("num_hidden_layers", "rms_norm_eps")}
        return nemotron_h.Model(
            nemotron_h.ModelArgs(
                model_type=kind,
                attention_bias=False,
                mamba_num_heads=4,
                mamba_head_dim=16,
                mamba_proj_bias=False,
                ssm_state_size=16,
                conv_kernel=4,
                n_groups=2,
                mlp_bias=False,
                layer_norm_epsilon=1e-5,
                use_bias=False,
                use_conv_bias=True,
                hybrid_override_pattern=["M", "*", "-", "M"],
                head_dim=16,
                **args,
            )
        )
    if kind == "lfm2":  # short convolutions and attention
        args = {k: v for k, v in common.items() if k not in ("num_hidden_layers", "rms_norm_eps")}
        model = lfm2.Model(
            lfm2.ModelArgs(
                model_type=kind,
                num_hidden_layers=3,
                norm_eps=1e-5,
                conv_bias=False,
                conv_L_cache=3,
                block_dim=HIDDEN,
                block_multiple_of=16,
                block_ffn_dim_multiplier=1.0,
                block_auto_adjust_ff_dim=False,
                layer_types=["conv", "full_attention", "conv"],
                **args,
            )
        )
        # Its tied embedding at full scale makes every token predict itself.
        model.model.embed_tokens.weight = model.model.embed_tokens.weight * 0.05
        return model
    if kind == "qwen3_moe":
        return qwen3_moe.Model(
            qwen3_moe.ModelArgs(
                model_type=kind,
                head_dim=16,
                rope_theta=10000.0,
                tie_word_embeddings=False,
                norm_topk_prob=True,
                **experts,
                **common,
            )
        )
    if kind == "mixtral":
        args = {k: v for k, v in common.items() if k != "max_position_embeddings"}
        return mixtral.Model(mixtral.ModelArgs(model_type=kind, num_local_experts=4, num_experts_per_tok=2, **args))
    raise ValueError(kind)


def tiny_drafter(
    seed: int = 0, rnn: bool = True, exit_dim: int = 2 * HIDDEN, layers: int = 1, draft_vocab=None
) -> Drafter:
    mx.random.seed(1000 + seed)
    args = DrafterArgs(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        exit_dim=exit_dim,
        num_draft_layers=layers,
        rnn=rnn,
        draft_vocab_size=draft_vocab,
    )
    drafter = Drafter(args)
    if draft_vocab:
        drafter.draft_token_ids = mx.random.permutation(VOCAB)[:draft_vocab].astype(mx.int32)
    mx.eval(drafter.parameters())
    return drafter


def tiny_redrafter(kind="llama", seed=0, quantize=False, **drafter_kwargs) -> ReDrafter:
    return ReDrafter(BaseModel(tiny_model(kind, seed, quantize)), tiny_drafter(seed, **drafter_kwargs))


def mlx_lm_greedy(model, prompt, num_tokens):
    """mlx-lm's own greedy decoding: the reference every parity test compares with."""
    steps = generate_step(mx.array(prompt), model, max_tokens=num_tokens)
    return [token for token, _ in itertools.islice(steps, num_tokens)]


def run(redrafter, prompts, **kwargs):
    """``generate_steps`` to the end: (tokens per prompt, accepted drafts per
    step). Keywords naming ``DraftSettings`` fields make its ``draft``."""
    names = {f.name for f in fields(DraftSettings)}
    draft = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
    if draft:
        kwargs["draft"] = DraftSettings(**draft)
    outputs, accepted = [[] for _ in prompts], []
    for step in generate_steps(redrafter, prompts, **kwargs):
        for out in step:
            outputs[out.row] += out.tokens
            if out.num_accepted is not None:
                accepted.append(out.num_accepted)
    return outputs, accepted


@pytest.fixture
def prompt():
    return [5, 17, 42, 99, 3, 250, 7, 18]


class OracleDrafter:
    """A test double with the drafter's interface that drafts the base
    model's true greedy continuations of known sequences.

    It finds where it is by matching the hidden state it is given against the
    base model's hidden states over each of ``sequences`` (prompt +
    reference continuation), and counts drafting depth in its state. With ``corrupt``,
    the drafted token at a pseudo-random depth in 1..corrupt (fixed per
    position) is replaced by a wrong one, so acceptance lengths vary.
    """

    def __init__(self, base: BaseModel, sequences: list, corrupt: int = 0):
        # Sequences side by side, each followed by 16 filler positions that
        # depths past its end read.
        flat, hidden = [], []
        for sequence in sequences:
            flat += sequence + [0] * 16
            hidden += [base.backbone(mx.array([sequence]))[0], mx.full((16, base.hidden_size), 1e6)]
        self.sequence = mx.array(flat, mx.int32)
        self.hidden = mx.concatenate(hidden)  # (T, hidden)
        self.corrupt = corrupt
        self.wrong_depth = mx.random.randint(1, corrupt + 1, (len(flat),), key=mx.random.key(7)) if corrupt else None
        self.draft_vocab_size = base.vocab_size

    def update_state(self, token_embeddings, state):
        depth = mx.zeros(token_embeddings.shape[:-1] + (1,)) if state is None else state
        return depth + 1

    def read_hidden(self, hidden):
        return hidden

    def search_log_probs(self, hidden, state, rows=None):
        distance = ((hidden[..., None, :] - self.hidden) ** 2).sum(-1)  # (..., T)
        position = mx.argmin(distance, axis=-1)
        depth = state[..., 0].astype(mx.int32)
        token = self.sequence[position + 1 + depth]
        if self.corrupt:
            wrong = self.wrong_depth[position] == depth
            token = mx.where(wrong, (token + 1) % self.draft_vocab_size, token)
        one_hot = mx.arange(self.draft_vocab_size) == token[..., None]
        return mx.where(one_hot, 0.0, -1e9 - mx.arange(self.draft_vocab_size))

    def token_ids(self, draft_indices):
        return draft_indices


def run_cli(*args, input=None, timeout=600, env=None, cwd=ROOT):
    """Run the command line from this checkout (``env``: variables to set
    for it; ``cwd``: the working folder); returns the completed process."""
    import subprocess

    env = dict(os.environ, **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "redrafter_mlx.cli", *map(str, args)],
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
    )


def start_server(*args) -> tuple:
    """Start ``redrafter-mlx serve`` from this checkout with ``args`` on a
    free loopback port; returns (process, url, port) once /health answers."""
    import socket
    import subprocess
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "redrafter_mlx.cli", "serve", "--port", str(port), *map(str, args)],
        cwd=ROOT,
        env=dict(os.environ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while True:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return process, url, port
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.time() > deadline:
            process.kill()
            pytest.fail(f"the server did not start: {process.communicate()[1]}")
        time.sleep(0.2)


def stop_server(process) -> None:
    """Ctrl-C the server, killed if it has not exited 30 s later."""
    import signal

    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        finally:
            process.kill()


CHAT_VOCAB = 512
CHAT_PROMPT = "pick a word"
CHAT_SETTINGS = [dict(temp=1.0, top_k=4), dict(temp=0.7, top_p=0.9)]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def processed_probs(logits, settings):
    """The distribution a token is sampled from, as mlx-lm defines it
    (float64 numpy, over the vocabulary)."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if settings.get("top_p", 1.0) < 1.0:
        logprobs = apply_top_p(logprobs, settings["top_p"])
    if settings.get("min_p", 0.0) > 0.0:
        logprobs = apply_min_p(logprobs, settings["min_p"])
    if settings.get("top_k", 0) > 0:
        logprobs = apply_top_k(logprobs, settings["top_k"])
    probs = np.array(mx.softmax(logprobs / settings["temp"], axis=-1)).astype(np.float64)
    return probs / probs.sum(axis=-1, keepdims=True)


def assert_same_distribution(counts, joint, min_p=1e-3):
    """Chi-square goodness of fit, merging cells expected below 5; any
    sample in a cell of probability 0 fails."""
    # Imported here: processes the tests launch import this file, and scipy
    # fails to import where torch is hidden (launched_processes_without_torch).
    from scipy.stats import chisquare

    total = counts.sum()
    expected = joint.ravel() * total
    observed = counts.ravel().astype(float)
    assert observed[expected == 0].sum() == 0, "samples outside the distribution's support"
    small = (expected < 5) & (expected > 0)
    exp = np.append(expected[expected >= 5], expected[small].sum())
    obs = np.append(observed[expected >= 5], observed[small].sum())
    if not small.any():
        exp, obs = exp[:-1], obs[:-1]
    p_value = chisquare(obs, exp * obs.sum() / exp.sum()).pvalue
    assert p_value > min_p, p_value
    return p_value


def save_word_tokenizer(folder, vocab_size: int) -> None:
    """A word-level tokenizer with a chat template: words w0 .. w{n}, the
    chat words and special tokens, split on white space."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<|im_start|>", "<|im_end|>"]
    words = special + ["user", "assistant", "system"] + CHAT_PROMPT.split()
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        chat_template=CHAT_TEMPLATE,
    )
    hf.save_pretrained(folder)


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory):
    """A tiny random llama with a word-level tokenizer and a chat template,
    saved as an mlx-lm folder, and a drafter folder whose draft vocabulary is
    the tokens the model is likely to sample after ``CHAT_PROMPT`` (first
    and second token, under ``CHAT_SETTINGS``), so its beams share prefixes
    and are often accepted. The output head is scaled so that top-p keeps a
    handful of tokens. Returns (model folder, drafter folder, prompt ids,
    [(p1 (V,), {token: p2 (V,)}) per settings], {token: the drafter's
    probability})."""
    from mlx_lm.utils import load_tokenizer, save_config, save_model

    from redrafter_mlx.drafting.drafter import save_drafter
    from redrafter_mlx.serving.api import encode_prompt

    root = tmp_path_factory.mktemp("chat-model")
    model = tiny_model("llama", seed=21, vocab=CHAT_VOCAB)
    model.lm_head.weight = model.lm_head.weight * 16.0
    save_model(root / "model", model)
    save_config(dict(vars(model.args)), root / "model" / "config.json")
    save_word_tokenizer(root / "model", CHAT_VOCAB)
    tokenizer = load_tokenizer(root / "model")

    prompt = encode_prompt(tokenizer, CHAT_PROMPT)
    exact, likely = [], set()
    for settings in CHAT_SETTINGS:
        p1 = processed_probs(model(mx.array([prompt]))[0, -1], settings)
        p2 = {int(a): processed_probs(model(mx.array([prompt + [int(a)]]))[0, -1], settings) for a in np.nonzero(p1)[0]}
        exact.append((p1, p2))
        likely |= set(p2) | {int(b) for p in p2.values() for b in np.nonzero(p)[0]}
    assert not likely & set(tokenizer.eos_token_ids), "EOS would cut samples short; pick another seed"

    # A context-free drafter: zero input projection, so the residual block
    # outputs silu(1) everywhere and the vocab projection's row sums are its
    # logits: log of how likely each token is as the second one.
    likely = sorted(likely)
    second = sum(p1[a] * p2[a] for p1, p2 in exact for a in p2)[likely]
    drafter = Drafter(DrafterArgs(vocab_size=CHAT_VOCAB, hidden_size=HIDDEN, exit_dim=32, draft_vocab_size=len(likely)))
    drafter.input_proj.weight = mx.zeros_like(drafter.input_proj.weight)
    drafter.input_proj.bias = mx.zeros_like(drafter.input_proj.bias)
    drafter.lm_head[0].linear.weight = mx.zeros_like(drafter.lm_head[0].linear.weight)
    drafter.lm_head[0].linear.bias = mx.ones_like(drafter.lm_head[0].linear.bias)
    preference = np.log(second + 1e-6).astype(np.float32)
    drafter.lm_head[1].weight = mx.broadcast_to(
        mx.array(preference / (32 * float(nn.silu(mx.array(1.0)))))[:, None], (len(likely), 32)
    )
    drafter.draft_token_ids = mx.array(likely, mx.int32)
    save_drafter(drafter, str(root / "drafter"))
    draft_q = np.exp(preference - np.logaddexp.reduce(preference))
    return str(root / "model"), str(root / "drafter"), prompt, exact, dict(zip(likely, draft_q))


@pytest.fixture(scope="session")
def smol_drafter(tmp_path_factory):
    """A random drafter shaped for SmolLM2-135M (hidden 576, vocab 49152)."""
    from redrafter_mlx.drafting.drafter import save_drafter

    mx.random.seed(0)
    drafter = Drafter(DrafterArgs(vocab_size=49152, hidden_size=576, exit_dim=64, num_draft_layers=1))
    path = tmp_path_factory.mktemp("drafters") / "smol-random"
    save_drafter(drafter, str(path))
    return str(path)


TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|> system {% for t in tools %}{{ t.function.name }} {% endfor %}<|im_end|> {% endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}<|im_start|> tool <tool_response> {{ m.content }} </tool_response> <|im_end|> "
    "{%- elif m.tool_calls -%}<|im_start|> assistant "
    "{%- for tool_call in m.tool_calls %}{% if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}"
    ' <tool_call> {"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }} } </tool_call>{% endfor %} <|im_end|> '
    "{%- else -%}<|im_start|> {{ m.role }} {{ m.content }} <|im_end|> {% endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{%- if messages[-1].role == 'tool' -%}<|im_start|> answer {%- else -%}<|im_start|> assistant {%- endif -%}{%- endif -%}"
)
# A scripted model: each word is followed by the next of its chain, whatever
# came before (a bigram model), so its answers are known in advance.
TOOL_CHAINS = [
    [
        "assistant",
        "<tool_call>",
        '{"name":',
        '"get_weather",',
        '"arguments":',
        '{"city":',
        '"Paris"}',
        "}",
        "</tool_call>",
        "<|im_end|>",
    ],
    ["answer", "It", "is", "sunny.", "<|im_end|>"],
    ["loop", "again", "and", "loop"],
]
TOOL_WORDS = [
    "<unk>",
    "<|im_start|>",
    "<|im_end|>",
    "user",
    "system",
    "tool",
    "<tool_response>",
    "</tool_response>",
    "Weather",
    "in",
    "Paris?",
    "get_weather",
]


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory):
    """A model folder whose chat template has a tool-call syntax (the family
    mlx-lm's ``json_tools`` parser reads) and whose scripted weights answer
    a user with a call of ``get_weather`` for Paris and a tool's result
    with "It is sunny.". Its context is 4096 tokens."""
    from mlx_lm.models import llama as llama_module
    from mlx_lm.utils import save_config, save_model
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = list(dict.fromkeys(TOOL_WORDS + [w for chain in TOOL_CHAINS for w in chain]))
    words += [f"w{i}" for i in range(64 - len(words))]
    size = len(words)
    index = {w: i for i, w in enumerate(words)}
    follows = {index[a]: index[b] for chain in TOOL_CHAINS for a, b in zip(chain, chain[1:])}
    args = llama_module.ModelArgs(
        model_type="llama",
        hidden_size=size,
        num_hidden_layers=1,
        intermediate_size=16,
        num_attention_heads=4,
        num_key_value_heads=4,
        rms_norm_eps=1e-5,
        vocab_size=size,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    model = llama_module.Model(args)
    layer = model.model.layers[0]
    layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
    layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    model.model.embed_tokens.weight = mx.eye(size)
    head = np.zeros((size, size), np.float32)
    for a in range(size):
        head[follows.get(a, index["<|im_end|>"]), a] = 2.0
    model.lm_head.weight = mx.array(head)
    mx.eval(model.parameters())
    folder = tmp_path_factory.mktemp("tool-model")
    save_model(folder, model)
    save_config(dict(vars(args)), folder / "config.json")
    tokenizer = Tokenizer(models.WordLevel(index, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        chat_template=TOOL_TEMPLATE,
    ).save_pretrained(folder)
    return str(folder)
