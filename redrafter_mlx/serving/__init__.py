"""What users run: the text-level Python API, chat, prompts files, the
OpenAI and Anthropic HTTP APIs and their scheduler, and the benchmark."""
