"""``python -m soup_core`` is ``soup`` (used by ``accelerate launch -m soup_core``)."""

from soup_core.cli.main import main

main()
