"""The model card: its front matter, and the account of a made drafter."""

from conftest import tiny_drafter


def test_the_card_names_a_hub_base_model_in_its_front_matter(tmp_path):
    import json

    from redrafter_mlx.drafting.drafter import save_drafter
    from redrafter_mlx.training.card import base_model_entry, model_card

    entry = base_model_entry("org/some-model", "0123456789abcdef")
    assert entry == {"name": "org/some-model", "identity": "0123456789abcdef", "hub_id": "org/some-model"}
    assert base_model_entry(None, "x")["default"] is True
    save_drafter(tiny_drafter(), str(tmp_path / "d"), {"base_model": entry})
    card = model_card(tmp_path / "d")
    front = card.split("---")[1]
    assert "\nbase_model: org/some-model\n" in front and "tags:\n- redrafter\n- speculative-decoding\n- mlx\n" in front
    assert "--model org/some-model --drafter OWNER/NAME" in card
    assert json.loads((tmp_path / "d" / "config.json").read_text())["base_model"]["identity"] == "0123456789abcdef"


def test_the_cards_account_of_a_made_drafter_shows_what_really_ran():
    """A distillation stopped short shows the answers it has against the
    prompts planned, a plan cut by hand says so, and the speed names the
    held-out file it was measured on."""
    from redrafter_mlx.training.card import _made_section

    figures = {
        "speedup_median": 1.11,
        "speedup_min": 1.01,
        "speedup_max": 1.65,
        "tokens_per_step": 1.25,
        "nodes_per_step": 2.3,
    }
    made = {
        "command": "redrafter-mlx make-drafter --model M --output D",
        "kind": "text",
        "prompts": "openings.jsonl",
        "train_prompts": 10,
        "held_out_prompts": 2,
        "runs": [
            {"name": "distill-t0.7", "temp": 0.7, "count": 4080, "max_tokens": 256, "responses": 2048},
            {"name": "distill-t1", "temp": 1.0, "count": 100, "max_tokens": 256, "responses": 100},
        ],
        "note": "cut by hand",
        "held_out_file": "openings-heldout.jsonl",
        "stage_minutes": {"train": 32.0},
        "cpu_hours": 0.85,
        "hours": 0.53,
        "held_out_speed": {"temp 0.7": {"auto": figures}, "prompts": 12, "max_tokens": 256},
    }
    card = "\n".join(_made_section(made))
    assert "2,048 of 4,080 prompts at temperature 0.7" in card and "100 prompts at temperature 1" in card
    assert "| note | cut by hand |" in card
    assert "12 held-out prompts of `openings-heldout.jsonl`" in card and "1.11x (1.01-1.65)" in card
