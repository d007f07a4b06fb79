"""soup-plugin-cloud: ``soup train --cloud`` plans a run on cloud GPUs as a SkyPilot task, and
``--cloud-submit`` launches it through SkyPilot's Python API."""

__version__ = "0.1.0"
