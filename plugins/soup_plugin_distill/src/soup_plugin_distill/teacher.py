"""Loading the teacher once, frozen, and checking that it speaks the student's vocabulary.

Light at module level: transformers is imported inside the loader. The cheap checks (does the folder
exist, do two local folders' ``config.json`` agree on the vocabulary size) run in the pre-flight, before
any data or model is loaded; the loaded models are checked again at set-up, which also covers hub ids.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def looks_local(name: str) -> bool:
    """Whether ``name`` is meant as a folder rather than a hub id (``name`` or ``org/name``)."""
    return name.startswith((".", "/", "~")) or "\\" in name or name.count("/") > 1 or os.path.isdir(name)


def local_folder(name: str) -> Path | None:
    """The folder ``name`` names, or None for a hub id."""
    path = Path(os.path.expanduser(name))
    return path if looks_local(name) or path.is_dir() else None


def config_vocab_size(name: str) -> int | None:
    """The ``vocab_size`` in a local model folder's ``config.json`` (None: not a local folder, or unknown)."""
    from soup_core.default_plugins.transformers import inspect_base

    inspected = inspect_base(name)
    if inspected is not None:  # a GGUF file: its header counts the tokens
        return inspected[0].vocabulary if inspected[0] is not None and inspected[0].vocabulary else None
    folder = local_folder(name)
    if folder is None:
        return None
    try:
        data = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    size = data.get("vocab_size") if isinstance(data, dict) else None
    if size is None and isinstance(data, dict) and isinstance(data.get("text_config"), dict):
        size = data["text_config"].get("vocab_size")
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def vocab_mismatch_message(teacher: str, teacher_size: int, student: str, student_size: int) -> str:
    return (
        f"training.teacher_model: the teacher {teacher!r} predicts over {teacher_size} tokens "
        "but the student "
        f"{student!r} over {student_size}; distillation compares the two next-token distributions token by "
        "token, so both models must share one tokenizer and vocabulary. Use a teacher of the student's model "
        "family (same tokenizer and vocabulary size)"
    )


def output_vocab_size(model: Any) -> int:
    """How many logits the model produces per position (its output embedding's rows, else its config)."""
    head = None
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        head = None
    weight = getattr(head, "weight", None)
    if weight is not None and getattr(weight, "ndim", 0) == 2:
        return int(weight.shape[0])
    config = getattr(model, "config", None)
    size = getattr(config, "vocab_size", None)
    if size is None and config is not None and hasattr(config, "get_text_config"):
        size = getattr(config.get_text_config(), "vocab_size", None)
    if size is None:
        raise ValueError(f"cannot tell the vocabulary size of {type(model).__name__}")
    return int(size)


def load_teacher(name: str, *, dtype: Any, device: Any, error: type[Exception] = RuntimeError) -> Any:
    """Load the teacher from a local folder or a hub id: eval mode, every parameter frozen, on ``device``.

    Errors the user can fix are raised as ``error`` with what, where and how to fix it.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from soup_core.default_plugins.transformers import GGUFError, gguf_file, resolve_base

    folder = local_folder(name)
    if gguf_file(name) is not None:  # a GGUF teacher: its dequantised folder (built on first use)
        try:
            folder = Path(resolve_base(name, dtype))
        except GGUFError as exc:
            raise error(str(exc).replace("base:", "training.teacher_model:", 1)) from None
    if folder is not None and not folder.is_dir():
        raise error(
            f"training.teacher_model: model folder {name!r} does not exist; "
            "give the folder of a trained model "
            "or a hub model id"
        )
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # loading bars would interleave with the run's progress lines
    try:
        teacher = AutoModelForCausalLM.from_pretrained(
            str(folder) if folder is not None else name, dtype=dtype
        )
    except (OSError, ValueError) as exc:
        raise error(
            f"training.teacher_model: cannot load the teacher {name!r}: {exc}. "
            "Check the folder or hub id (and "
            "that you are online for a hub id that is not cached)"
        ) from exc
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    teacher.eval()
    teacher.requires_grad_(False)
    return teacher.to(device)


def check_vocabulary(
    student: Any, teacher: Any, *, student_name: str, teacher_name: str, error: type[Exception] = RuntimeError
) -> int:
    """Refuse a teacher whose logits do not cover the student's vocabulary one to one; returns the size."""
    student_size, teacher_size = output_vocab_size(student), output_vocab_size(teacher)
    if student_size != teacher_size:
        raise error(vocab_mismatch_message(teacher_name, teacher_size, student_name, student_size))
    return student_size


#: Files from which transformers can build a tokenizer; a teacher folder with none of them has no tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def missing_tokenizer_message(teacher_name: str) -> str:
    return (
        f"training.teacher_model: the teacher folder {teacher_name!r} holds no tokenizer "
        f"({', '.join(TOKENIZER_FILES)}), so nothing shows that it reads token ids as the student does; "
        "distillation compares the two next-token distributions token by token and would train on nonsense "
        "silently if they differ"
    )


MISSING_TOKENIZER_FIX = (
    "save the tokenizer the teacher was trained with into its folder (tokenizer.save_pretrained(folder)); "
    "if it was trained with the student's tokenizer, save the student's there"
)


def refuse_folder_without_tokenizer(teacher_name: str, *, error: type[Exception] = RuntimeError) -> None:
    """A local teacher folder must carry its tokenizer: refused without one (cheap, before any loading)."""
    from soup_core.default_plugins.transformers import gguf_file

    folder = local_folder(teacher_name)
    if gguf_file(teacher_name) is not None:
        return  # a GGUF file carries its tokenizer
    if folder is not None and folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise error(f"{missing_tokenizer_message(teacher_name)}. Fix: {MISSING_TOKENIZER_FIX}")


def check_tokenizer(
    student_tokenizer: Any, teacher_name: str, *, error: type[Exception] = RuntimeError
) -> None:
    """Load the teacher's tokenizer from where the teacher came from (its folder or its hub id, as
    transformers resolves it, cache included) and refuse one that maps tokens to other ids than the
    student's: equal vocabulary sizes with a different vocabulary would distil nonsense silently. A teacher
    without a loadable tokenizer is refused too: there would be nothing to check."""
    refuse_folder_without_tokenizer(teacher_name, error=error)
    from transformers import AutoTokenizer

    from soup_core.default_plugins.transformers import gguf_file, load_tokenizer

    folder = local_folder(teacher_name)
    source = str(folder) if folder is not None else teacher_name
    try:
        teacher_tokenizer = (load_tokenizer(teacher_name) if gguf_file(teacher_name) is not None  # from the file
                             else AutoTokenizer.from_pretrained(source))
    except (OSError, ValueError, TypeError) as exc:
        raise error(
            f"training.teacher_model: cannot load the tokenizer of the teacher {teacher_name!r} ({exc}); "
            "distillation needs both models to share one tokenizer and this one cannot be checked. "
            f"Fix: {MISSING_TOKENIZER_FIX}"
        ) from exc
    mine, theirs = student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if mine == theirs:
        return
    differing = sorted(t for t in set(mine) | set(theirs) if mine.get(t) != theirs.get(t))
    example = differing[0]
    raise error(
        f"training.teacher_model: the teacher's tokenizer in {teacher_name!r} differs from the student's: "
        f"{len(differing)} tokens map to other ids (e.g. {example!r}: student {mine.get(example)}, teacher "
        f"{theirs.get(example)}); distillation needs both models to share one tokenizer. "
        "Use a teacher trained "
        "with the student's tokenizer"
    )
