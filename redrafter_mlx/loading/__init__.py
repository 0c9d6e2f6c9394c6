"""Loading a base model (mlx-lm folder, Hub id or GGUF file) and its drafter."""
