"""What users run: the text-level Python API, chat, prompts files, the
OpenAI-compatible server and its scheduler, and the benchmark."""
