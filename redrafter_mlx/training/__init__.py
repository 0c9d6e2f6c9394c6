"""Making a drafter: distillation data, self-written prompts, training, and
the replay that measures a drafter without running the base model."""
