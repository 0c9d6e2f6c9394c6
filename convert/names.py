"""Mapping the tensor names other trainers use onto the official ones.

Official (see ``redrafter_mlx.drafter``): ``input_proj.{weight,bias}``,
``lm_head.{i}.linear.{weight,bias}`` (residual blocks), ``lm_head.{N}.weight``
(vocab projection), ``rnn_u.{weight,bias}``, ``rnn_w.weight``, and the
project's ``draft_token_ids``.

Variants understood:
- wrapper prefixes, in any combination: ``module.`` (DDP / DataParallel),
  ``model.``, ``_orig_mod.`` (torch.compile), ``drafter.`` / ``redrafter.``
  (TensorRT-LLM and trainers that save the whole ReDrafter module). When the
  drafter sits under ``drafter.``, base-model tensors beside it (``llm.``,
  ``base_model.``) are dropped;
- ``lm_heads.{i}`` for ``lm_head.{i}``; ``input_projs`` or ``input_projs.0``
  for ``input_proj``;
- TensorRT-LLM's split layout: residual blocks as ``layers.{i}.linear`` and
  the vocab projection as an unnumbered ``lm_head.weight`` (it becomes
  ``lm_head.{number of blocks}``);
- residual blocks saved without the inner ``linear``: ``lm_head.{i}.weight``
  together with ``lm_head.{i}.bias`` (the vocab projection has no bias).
"""

import re

from redrafter_mlx.errors import UserError

PREFIXES = ("module.", "model.", "_orig_mod.", "drafter.", "redrafter.")
BASE_MODEL_PREFIXES = ("llm.", "base_model.", "base.")
RENAMES = (
    (re.compile(r"^lm_heads\."), "lm_head."),
    (re.compile(r"^input_projs\.(0\.)?"), "input_proj."),
    (re.compile(r"^layers\.(\d+)\."), r"lm_head.\1."),
)


def normalize_names(names) -> tuple[dict, list]:
    """Return ({source name: official name} for the tensors to keep, notes)."""
    notes = []
    stripped, dropped = {}, []
    under_drafter = any(_strip(n)[1] for n in names)
    for name in names:
        short, saw_drafter_prefix = _strip(name)
        if under_drafter and not saw_drafter_prefix and short.startswith(BASE_MODEL_PREFIXES):
            dropped.append(name)
            continue
        stripped[name] = short
    if dropped:
        notes.append(f"dropped {len(dropped)} base-model tensors beside the drafter (e.g. {dropped[0]})")

    unnumbered_head = "lm_head.weight" in stripped.values()
    renamed = {}
    for name, short in stripped.items():
        for pattern, replacement in RENAMES:
            short = pattern.sub(replacement, short)
        renamed[name] = short

    # Residual blocks without the inner ``linear``: a numbered lm_head entry
    # that has a bias.
    with_bias = {m.group(1) for s in renamed.values() if (m := re.match(r"^lm_head\.(\d+)\.bias$", s))}
    blocks = set()
    for name, short in renamed.items():
        m = re.match(r"^lm_head\.(\d+)\.(weight|bias)$", short)
        if m and m.group(1) in with_bias:
            renamed[name] = f"lm_head.{m.group(1)}.linear.{m.group(2)}"
        m = re.match(r"^lm_head\.(\d+)\.linear\.", renamed[name])
        if m:
            blocks.add(int(m.group(1)))
    if unnumbered_head:
        count = len(blocks)
        for name, short in renamed.items():
            if short == "lm_head.weight":
                renamed[name] = f"lm_head.{count}.weight"
        notes.append(f"took the unnumbered lm_head.weight as the vocab projection after {count} residual blocks")

    seen = {}
    for name, official in renamed.items():
        if official in seen:
            raise UserError(f"tensors {seen[official]!r} and {name!r} both map to {official!r}")
        seen[official] = name
    changed = sum(1 for name, official in renamed.items() if name != official)
    if changed:
        example = next(f"{n} -> {o}" for n, o in renamed.items() if n != o)
        notes.append(f"renamed {changed} tensors to the official names (e.g. {example})")
    return renamed, notes


def _strip(name: str) -> tuple[str, bool]:
    """Drop wrapper prefixes; also say whether one of them was ``drafter.``."""
    saw_drafter = False
    changed = True
    while changed:
        changed = False
        for prefix in PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                saw_drafter = saw_drafter or prefix in ("drafter.", "redrafter.")
                changed = True
    return name, saw_drafter
