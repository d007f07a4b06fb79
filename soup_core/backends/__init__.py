"""Built-in backends. Each subpackage is import-light; engines load when a run is prepared."""
