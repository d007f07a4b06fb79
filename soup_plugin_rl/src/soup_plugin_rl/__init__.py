"""soup-plugin-rl: GRPO and its variants, and the preference losses, for Soup — through trl,
extended at its seams.

Import-light: the plugin module registers tasks, formats, config fields, support rows and probes; trl and
torch are imported when a run builds its trainer.
"""

__version__ = "0.1.0"
