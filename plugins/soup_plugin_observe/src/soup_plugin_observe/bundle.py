"""Crash bundles: one ``.tar.gz`` with what a maintainer needs to diagnose a run, and no secret.

It holds ``run.json`` (the tracker row, every metric, the quarantine, the checkpoints, the data files' names,
sizes and sha256), ``config.yaml`` (as the run wrote it), ``config.resolved.json`` (as the tracker keeps it),
``doctor.json`` (``soup doctor --json --quick``), ``traceback.txt``, ``output.log`` (the run's last
:data:`LOG_LINES` output lines), ``rewind.tail.jsonl`` (the rewind log's last lines: the run's last events),
``quarantine.jsonl`` and ``environment.json``. Every text in it is redacted (:class:`Redactor`): environment
variables whose name holds TOKEN, KEY, SECRET or PASSWORD (their values too, wherever they appear),
credentials inside URLs, and the home folder's path (``~``). Data rows only with ``with_data``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from soup_plugin_observe.facts import LOG_NAME, QUARANTINE_FILE, RunFacts, from_tracker, read_tail, run_part

LOG_LINES = 200
REWIND_LINES = 200
SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD", re.I)
URL_CREDENTIALS = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s:@'\"]+(?::[^/\s@'\"]*)?@")
REDACTED = "[redacted]"
MIN_SECRET = 8  # a shorter value (a flag, "false", "1") is not looked for in the texts: it would blank half of them


class Redactor:
    """Removes secrets from texts, as the module docstring says; ``enabled=False`` leaves them (tests' control)."""

    def __init__(self, environ: Mapping[str, str] | None = None, home: str | None = None, *,
                 enabled: bool = True) -> None:
        environ = dict(os.environ if environ is None else environ)
        self.enabled = enabled
        self.values = sorted({v for k, v in environ.items() if SECRET_NAME.search(k) and len(v) >= MIN_SECRET},
                             key=len, reverse=True)
        home = home if home is not None else os.path.expanduser("~")
        self.home = home.rstrip("/") if home and home.rstrip("/") else None

    def __call__(self, text: str) -> str:
        if not self.enabled:
            return text
        for value in self.values:
            text = text.replace(value, REDACTED)
        text = URL_CREDENTIALS.sub(rf"\1{REDACTED}@", text)
        return text.replace(self.home, "~") if self.home else text

    def data(self, value: Any) -> Any:
        """``value`` (JSON data) with every string in it redacted: JSON members stay valid JSON."""
        if isinstance(value, str):
            return self(value)
        if isinstance(value, dict):
            return {self(str(k)): self.data(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.data(v) for v in value]
        return value

    def environ(self, environ: Mapping[str, str]) -> dict[str, str]:
        return {k: REDACTED if self.enabled and SECRET_NAME.search(k) else self(v) for k, v in sorted(environ.items())}


def _doctor() -> dict[str, Any]:
    """``soup doctor --json --quick`` (versions, no torch import) in a fresh process."""
    try:
        done = subprocess.run([sys.executable, "-m", "soup_core", "doctor", "--json", "--quick"], capture_output=True,
                              text=True, timeout=30)
        return json.loads(done.stdout)
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        return {"error": f"soup doctor --json --quick failed: {type(exc).__name__}: {exc}"}


def _data_files(config: dict[str, Any]) -> list[dict[str, Any]]:
    files = []
    data = config.get("data") or {}
    for key, value in data.items():
        entries = value if isinstance(value, list) else [value] if isinstance(value, str) else []
        for entry in entries:
            raw = entry.get("path") if isinstance(entry, dict) else entry
            if not isinstance(raw, str):
                continue
            path = Path(raw).expanduser()
            item: dict[str, Any] = {"key": f"data.{key}", "path": raw, "name": path.name}
            if path.is_file():
                digest = hashlib.sha256()
                with path.open("rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        digest.update(block)
                item.update(size=path.stat().st_size, sha256=digest.hexdigest())
            else:
                item["missing"] = True
            files.append(item)
    return files


def _tail_lines(text: str, n: int) -> str:
    lines = text.splitlines(keepends=True)
    return "".join(lines[-n:])


def build(facts: RunFacts, *, exception: BaseException | None = None, with_data: bool = False,
          redactor: Redactor | None = None) -> bytes:
    """The bundle of ``facts`` (a run read from the tracker) as gzip'd tar bytes."""
    import traceback as tb

    redact = redactor or Redactor()
    folder = Path(facts.output_dir) if facts.output_dir else None
    trace = "".join(tb.format_exception(exception)) if exception is not None else facts.traceback
    data = _data_files(facts.config)
    doc = {"format": 1, "made_at": time.time(), "tracker_row": facts.row(),
           "metrics": {k: [[s, None if v != v else v] for s, v in pairs] for k, pairs in facts.metrics.items()},
           "quarantine": facts.quarantine, "checkpoints": facts.checkpoints, "data_files": data}
    as_json = {"run.json": doc, "config.resolved.json": facts.config, "doctor.json": _doctor(),
               "environment.json": {"python": sys.version, "platform": sys.platform,
                                    "environ": redact.environ(os.environ)}}
    members: dict[str, str | bytes] = {name: json.dumps(redact.data(json.loads(json.dumps(value, default=str))),
                                                        indent=None if name == "run.json" else 1).encode("utf-8")
                                       for name, value in as_json.items()}
    members.update({"traceback.txt": trace, "output.log": _tail_lines(facts.log, LOG_LINES)})
    if folder is not None:
        for name, member in (("soup_config.yaml", "config.yaml"), (QUARANTINE_FILE, QUARANTINE_FILE)):
            if (folder / name).is_file():
                members[member] = (folder / name).read_text(encoding="utf-8", errors="replace")
        if (folder / "rewind.jsonl").is_file():
            members["rewind.tail.jsonl"] = _tail_lines(read_tail(folder / "rewind.jsonl", 1 << 20), REWIND_LINES)
    if with_data:
        for item in data:
            if not item.get("missing"):
                members[f"data/{item['name']}"] = Path(item["path"]).expanduser().read_bytes()
    buffer = io.BytesIO()
    top = f"soup-crash-{facts.run_id}"
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, content in members.items():
            raw = redact(content).encode("utf-8") if isinstance(content, str) else content
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size, info.mtime, info.mode = len(raw), int(time.time()), 0o644
            tar.addfile(info, io.BytesIO(raw))
    return buffer.getvalue()


def write_crash_bundle(run_id: str, output_dir: str, exception: BaseException | None) -> Path:
    """``OUTPUT/soup-crash-RUN.tar.gz`` for a run that just failed (listed in the run's manifest first)."""
    from soup_core.io import atomic_write, record_output

    folder = Path(output_dir)
    name = f"soup-crash-{run_id}.tar.gz"
    facts = from_tracker(run_id, every_metric=True)
    log = folder / LOG_NAME
    if log.is_file():
        facts.log = run_part(read_tail(log), run_id)
    record_output(folder, name)
    return atomic_write(folder / name, build(facts, exception=exception))
