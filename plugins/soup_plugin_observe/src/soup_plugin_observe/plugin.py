"""The ``observe`` plugin: ``soup why``, ``soup bundle``, ``soup runs plot``, ``soup tui``, and the crash bundle a
failed run writes. Registration is cheap: this module imports the core's contracts only."""

from __future__ import annotations

from soup_core import Command, hookimpl

#: Hook-API versions this plugin supports (min, max).
SOUP_HOOK_API = (1, 1)


@hookimpl
def soup_register_commands() -> list[Command]:
    from soup_plugin_observe.bundle_cmd import BUNDLE_HELP, bundle
    from soup_plugin_observe.plot_cmd import PLOT_HELP, plot
    from soup_plugin_observe.tui_cmd import TUI_HELP, tui
    from soup_plugin_observe.why_cmd import WHY_HELP, why

    return [Command(name="why", target=why, help=WHY_HELP), Command(name="bundle", target=bundle, help=BUNDLE_HELP),
            Command(name="runs plot", target=plot, help=PLOT_HELP), Command(name="tui", target=tui, help=TUI_HELP)]


@hookimpl
def soup_run_end(run_id: str, output_dir: str, status: str, exception: BaseException | None) -> list[str] | None:
    """A failed run leaves a crash bundle in its output folder, and says so last."""
    if status != "failed":
        return None
    from soup_plugin_observe.bundle import write_crash_bundle

    path = write_crash_bundle(run_id, output_dir, exception)
    return [f"crash bundle: {path} (soup why {path} reads it; attach it to a bug report)"]
