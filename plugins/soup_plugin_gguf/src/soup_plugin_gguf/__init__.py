"""soup-plugin-gguf: ``soup export TARGET --to gguf`` and ``--to ollama``."""
