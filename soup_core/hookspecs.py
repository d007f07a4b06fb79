"""Every hook Soup calls, in one place; docs/plugins.md ("Hooks, one by one") is their reference.

Registration hooks (``soup_register_*``) return lists of named things, once per process at plugin load, and
must be cheap (no heavy imports, no I/O). Lifecycle hooks are called during a run. Run events reach the
``Recorder`` and ``Controller`` instances a plugin registers, not hooks. The API grows by adding hooks or
arguments, never by changing one in place; an implementation may take fewer arguments than its spec.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    from soup_core.contracts import (
        Backend,
        Command,
        ConfigField,
        Controller,
        DataFormat,
        ExportTarget,
        LoadedModel,
        PreflightReport,
        Probe,
        Recorder,
        Support,
        Task,
    )

PROJECT = "soup"
#: The hook-API version this core implements. Bumped when hooks or arguments are added.
HOOK_API_VERSION = 1

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# ------------------------------------------------------------------------------- registration hooks


@hookspec
def soup_register_backends() -> list[type[Backend]]:
    """Return backend classes this plugin provides (each with a unique ``name``).

    Called once at load. Must not import heavy libraries: a backend class imports its engine inside
    its methods.
    """


@hookspec
def soup_register_tasks() -> list[type[Task]]:
    """Return task classes this plugin provides (each with a unique ``name``).

    Called once at load. The core never names a task other than its built-in ``sft``; everything it
    needs to know about a task is on the class (data keys, formats, capabilities).
    """


@hookspec
def soup_register_data_formats() -> list[DataFormat]:
    """Return data formats (chat, alpaca, ...) this plugin provides.

    Called once at load. ``to_example`` and ``detect`` must be pure Python (``soup rewind`` rebuilds
    training lists without torch).
    """


@hookspec
def soup_register_recorders() -> list[type[Recorder]]:
    """Return recorder classes. One instance of each is created per run; its methods observe the run.

    A recorder that raises is reported once with its plugin's name and disabled; the run goes on.
    """


@hookspec
def soup_register_controllers() -> list[type[Controller]]:
    """Return controller classes. One instance per run gets ``on_step`` after every optimizer step and
    may return actions (set a coefficient, roll back, stop) that the backend applies; ``before_update``
    (optional, not a hook: the hook API is unchanged) may skip an update or exclude rows before it is applied.

    A controller that raises stops the run with a message naming the plugin.
    """


@hookspec
def soup_register_commands() -> list[Command]:
    """Return CLI commands (``soup NAME``).

    Called when the CLI starts, for every invocation, including ``soup --help``: the command's module
    must import only light libraries at module level.
    """


@hookspec
def soup_register_export_targets() -> list[ExportTarget]:
    """Return the formats ``soup export TARGET --to NAME`` writes (each with a unique ``name``).

    Called when the CLI starts: ``ExportTarget.run`` imports its heavy libraries when it is called.
    """


@hookspec
def soup_register_config_fields() -> list[ConfigField]:
    """Return config fields this plugin adds (full dotted paths: ``training.rewind_log``).

    Two plugins declaring the same path is a load-time error naming both.
    """


@hookspec
def soup_register_support() -> list[Support]:
    """Return support-table rows: which fields a (backend, task) pair honours.

    Rows for one pair from several plugins are merged. A non-observer field set to a non-default value
    that the chosen pair does not honour is refused at config time.
    """


@hookspec
def soup_register_probes() -> list[Probe]:
    """Return capability probes. Cheap probes (``deep=False``) run at every load and must not import
    heavy libraries; deep probes run before a run that uses the plugin and under
    ``soup plugins list --check``. A failed probe makes the plugin (or the scoped backend/task)
    unavailable, with the reason and the fix.
    """


# ---------------------------------------------------------------------------------- lifecycle hooks


@hookspec(firstresult=True)
def soup_load_model(config: Any, backend: str, task: Any) -> LoadedModel | None:
    """Load the model and tokenizer for a run, or return None to let the next implementation try.

    The first non-None answer wins (the streaming plugin answers when ``training.stream_layers`` is
    true; the built-in backend answers last). Called after pre-flight and data loading, once per run
    (per rank). Must not start training.
    """


@hookspec(firstresult=True)
def soup_train_elsewhere(config_path: Any, options: dict[str, Any]) -> int | None:
    """Take ``soup train --cloud``: return its exit code, or None to let the next implementation try.

    ``options`` holds the cloud flags and the command line's overrides (paths absolute). None answering is
    refused, naming soup-plugin-cloud. Called before anything here checks the config or loads torch.
    """


@hookspec
def soup_preflight(config: Any) -> PreflightReport | None:
    """Check a validated config before any data or model is loaded (also under ``--dry-run``).

    Return None when the plugin has nothing to say, else a report whose lines join the printed plan;
    a report with a ``refusal`` stops the run with that reason and its fix. Must not load a model.
    """


@hookspec
def soup_run_end(run_id: str, output_dir: str, status: str, exception: BaseException | None) -> list[str] | None:
    """Observe a run's end (rank 0, once its tracker row holds the status) and return lines to say last.

    ``status`` is completed, stopped, failed or interrupted; ``exception`` is what ended a failed or interrupted
    run (None otherwise). A raising implementation is reported with its plugin's name; the run's outcome stands.
    """
