"""A run imports only the libraries it uses.

peft imports bitsandbytes whenever it is installed: ``peft.helpers`` tries ``import bitsandbytes`` when peft
is imported, and its LoRA dispatch asks ``importlib.util.find_spec("bitsandbytes")`` and then imports its
quantised layers. Importing bitsandbytes compiles kernels through torch's inductor (about a second on a CPU),
for nothing when the base is not quantised. Both checks read ``sys.modules`` first, and a ``None`` there is
how Python spells "not importable": ``import`` raises ``ImportError``, ``find_spec`` answers None. So while a
run without quantisation is set up (imports, model, trainer; and while the deep probe imports trl),
``sys.modules["bitsandbytes"]`` is None; then the entry goes and the libraries' availability caches are
cleared, so training (a plugin's own code) and a quantised run later in the same process find bitsandbytes
as if nothing had happened.

scipy likewise, but only while transformers' model module is imported: it imports its object-detection
losses, which import ``scipy.optimize`` (about half a second) when scipy is installed, and no causal language
model uses them. scipy stays importable for the rest of the run, where a plugin's task or reward may use it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

BITSANDBYTES = "bitsandbytes"
SCIPY = "scipy"

#: the libraries' cached answers to "is bitsandbytes installed?" (module, function with ``cache_clear``)
_CACHED_CHECKS = (
    ("peft.import_utils", "is_bnb_available"),
    ("peft.import_utils", "is_bnb_4bit_available"),
    ("transformers.utils.import_utils", "is_bitsandbytes_available"),
    ("transformers.utils.import_utils", "is_scipy_available"),
)


@contextlib.contextmanager
def without(*modules: str) -> Iterator[tuple[str, ...]]:
    """Make ``modules`` (top-level names) unimportable inside the block; yields those it blocked (one
    already imported stays as it is)."""
    blocked = tuple(m for m in modules if m not in sys.modules)
    before = set(sys.modules)
    for name in blocked:
        sys.modules[name] = None  # type: ignore[assignment]
    if blocked:  # an answer cached before the block ("installed") would make the import inside it fail
        _forget_answers((), before)
    try:
        yield blocked
    finally:
        for name in blocked:
            if sys.modules.get(name, False) is None:
                del sys.modules[name]
        if blocked:
            _forget_answers(blocked, before)


def _forget_answers(blocked: tuple[str, ...], before: set[str]) -> None:
    # a module imported inside the block decided what to define from "not installed" (peft's ``bnb``
    # submodules define their layers only when bitsandbytes imports): dropped, so it is imported afresh
    for name in [n for n in sys.modules if n not in before]:
        if name.rsplit(".", 1)[-1] in blocked or name.rsplit(".", 1)[-1] == "bnb":
            del sys.modules[name]
    for module, function in _CACHED_CHECKS:
        check = getattr(sys.modules.get(module), function, None)
        if hasattr(check, "cache_clear"):
            check.cache_clear()


@contextlib.contextmanager
def few_collections(young: int = 20_000) -> Iterator[None]:
    """Collect cyclic garbage rarely while a run is set up. Importing torch, transformers, peft and trl
    creates millions of objects that live as long as the process; at the default thresholds (a collection
    every 700 allocations, a full one every hundred) the collector walks them over and over, about a fifth
    of the imports' CPU time. Young objects are still collected, every ``young`` allocations; the thresholds
    come back afterwards, so training collects as it always did.

    Nothing is frozen (``gc.freeze()`` would save the trainer's first collections about 0.3 s of CPU): frozen
    objects drop out of ``gc.get_objects()``, which memory tools and a plugin's own checks read during the
    run, and would see no model there."""
    import gc

    before = gc.get_threshold()
    gc.set_threshold(max(young, before[0]), max(50, before[1]), max(100, before[2]))
    try:
        yield
    finally:
        gc.set_threshold(*before)


@contextlib.contextmanager
def known_packages() -> Iterator[None]:
    """trl calls ``importlib.metadata.packages_distributions()`` when it is imported, which reads the file
    list of every installed distribution (a quarter of a second). Inside the block that call is answered
    from ``$SOUP_HOME/cache/packages.json``, kept for this installation: every distribution at its version
    and place, and each folder of ``sys.path`` unchanged since (an install or an uninstall touches it)."""
    import importlib.metadata as metadata
    import json
    import os

    from soup_core.io import atomic_write, read_json_object
    from soup_core.probes import installation_key
    from soup_core.tracker.store import soup_home

    real = metadata.packages_distributions

    def kept() -> dict[str, list[str]]:
        stamps = []
        for entry in sys.path:
            with contextlib.suppress(OSError):
                stamps.append([entry, os.stat(entry or ".").st_mtime_ns])
        key = [installation_key(), stamps]
        path = soup_home() / "cache" / "packages.json"
        cached = read_json_object(path) or {}
        if cached.get("key") == key and isinstance(cached.get("packages"), dict):
            return {name: list(dists) for name, dists in cached["packages"].items()}
        answer = real()
        with contextlib.suppress(OSError):  # a cache that cannot be written only costs the next run time
            atomic_write(path, json.dumps({"key": key, "packages": answer}))
        return answer

    metadata.packages_distributions = kept  # type: ignore[assignment]
    try:
        yield
    finally:
        metadata.packages_distributions = real  # type: ignore[assignment]


def unused_by(config: Any) -> tuple[str, ...]:
    """The optional libraries a transformers run of ``config`` does not use, blocked while it runs."""
    quantization = getattr(getattr(config, "training", None), "quantization", None)
    return (BITSANDBYTES,) if quantization in (None, "none") else ()
