"""The core's own commands (default plugin ``core.cli``, registered in :mod:`.plugin`).

Each command's module is import-light: what a command needs is imported when it runs.
"""
