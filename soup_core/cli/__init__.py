"""The ``soup`` command line."""
