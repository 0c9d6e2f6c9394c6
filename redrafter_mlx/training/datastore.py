"""Adding a datastore to a drafter folder: its base model's distilled answers
back to back (``drafting.datastore``), the answers to the prompts that
training holds out left out, so that a drafter is measured on them fairly."""

from pathlib import Path

from .. import files
from ..drafting.datastore import Datastore
from ..drafting.drafter import CONFIG_FILE, DrafterArgs, read_config
from ..errors import UserError
from .card import refresh_card_datastore
from .config import TrainConfig
from .data import held_out_sequences
from .distill import Sequences, data_folders


def add_datastore(drafter: str, data: list) -> tuple[Path, int, int]:
    """Write ``datastore.npy`` into the drafter folder from the data folders,
    and describe it in the folder's model card (its ``| datastore |`` row,
    which ``train`` writes); returns (its path, tokens, answers)."""
    config_path = Path(drafter) / CONFIG_FILE
    if not config_path.is_file():
        raise UserError(f"drafter folder {drafter} has no {CONFIG_FILE}")
    args = DrafterArgs.from_dict(read_config(config_path))
    folders = data_folders(data)
    for folder in folders:
        folder.check_model(args.vocab_size, args.hidden_size)
    sequences = Sequences.concatenate([folder.load() for folder in folders])
    keep = ~held_out_sequences(sequences.prompt_index, TrainConfig().eval_fraction)
    store = Datastore.from_answers(sequences, keep, args.vocab_size)
    files.remove_temporaries(drafter)  # what a killed run left
    path = store.save(drafter)
    refresh_card_datastore(drafter)
    return path, int((store.tokens >= 0).sum()), int(keep.sum())
