"""The data formats (pure Python) and the reward functions (built-in, and a user's from a named file)."""

from __future__ import annotations

import pytest

from soup_plugin_rl.formats import FORMATS
from soup_plugin_rl.rewards import (
    RewardError,
    accuracy,
    build_rewards,
    check_spec,
    format_reward,
    length_reward,
    load_user_function,
)

FMT = {f.name: f for f in FORMATS}


def test_preference_rows():
    fmt = FMT["preference"]
    row = {"prompt": "Q?", "chosen": " yes", "rejected": " no", "id": 3}
    assert fmt.detect(row) and fmt.to_example(row) == {"prompt": "Q?", "chosen": " yes", "rejected": " no"}
    with pytest.raises(ValueError, match="missing key 'rejected'"):
        fmt.to_example({"prompt": "Q?", "chosen": "a"})
    with pytest.raises(ValueError, match="the same text"):
        fmt.to_example({"prompt": "Q?", "chosen": "a", "rejected": "a"})
    with pytest.raises(ValueError, match="'chosen' must be a string, got int"):
        fmt.to_example({"prompt": "Q?", "chosen": 1, "rejected": "a"})


def test_labelled_rows():
    fmt = FMT["prompt_completion_label"]
    assert fmt.to_example({"prompt": "", "completion": "x", "label": False}) == {
        "prompt": "",
        "completion": "x",
        "label": False,
    }
    with pytest.raises(ValueError, match="'label' must be true .* or false"):
        fmt.to_example({"prompt": "", "completion": "x", "label": 1})
    # ranks above the core's prompt_completion, which also matches these records
    assert fmt.priority > 20 and fmt.detect({"prompt": "", "completion": "x", "label": True})


def test_prompt_answer_rows():
    fmt = FMT["prompt_answer"]
    assert fmt.to_example({"prompt": "2+2?", "answer": 4}) == {"prompt": "2+2?", "answer": "4"}
    assert fmt.to_example({"prompt": "hi"}) == {"prompt": "hi", "answer": None}
    assert not fmt.detect({"prompt": "a", "completion": "b"})
    with pytest.raises(ValueError, match="'prompt' is empty"):
        fmt.to_example({"prompt": "  "})
    with pytest.raises(ValueError, match="'answer' must be a string or a number"):
        fmt.to_example({"prompt": "a", "answer": [1]})


def test_builtin_rewards():
    assert accuracy([" 4 ", "5", "x"], answer=["4", "4", None]) == [1.0, 0.0, None]
    chat = [[{"role": "assistant", "content": "4"}]]
    assert accuracy(chat, answer=["4"]) == [1.0]
    assert format_reward(["<think>a</think> <answer>4</answer>", "4"]) == [1.0, 0.0]
    assert length_reward(8)(["a", "b"], completion_ids=[[1, 2], [1] * 8]) == [0.75, 0.0]


def test_user_reward_is_loaded_from_the_named_file_only(tmp_path):
    file = tmp_path / "rewards.py"
    file.write_text(
        "def my_reward(completions, **kwargs):\n    return [float(len(c)) for c in completions]\n"
    )
    spec = f"{file}:my_reward"
    check_spec(spec)
    fn = load_user_function(spec)
    assert fn(["ab", "c"]) == [2.0, 1.0]
    assert [f.__name__ for f in build_rewards(["accuracy", spec, "length"], max_completion_length=4)] == [
        "accuracy",
        "my_reward",
        "length",
    ]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("rewards.py", "neither a built-in reward"),
        ("accurcy", "neither a built-in reward"),
        ("missing.py:f", "no such file"),
        ("{dir}/rewards.py:other", "defines no top-level function 'other'"),
        ("{dir}/broken.py:f", "cannot be parsed"),
    ],
)
def test_bad_reward_specs_say_what_and_how_to_fix(tmp_path, spec, message):
    (tmp_path / "rewards.py").write_text("def my_reward(completions, **kwargs):\n    return []\n")
    (tmp_path / "broken.py").write_text("def f(:\n")
    with pytest.raises(RewardError, match=message):
        check_spec(spec.format(dir=tmp_path), base_dir=tmp_path)


def test_a_user_file_that_raises_on_import_is_reported(tmp_path):
    (tmp_path / "bad.py").write_text("def f(**k):\n    return []\nraise RuntimeError('boom')\n")
    with pytest.raises(RewardError, match="raised RuntimeError: boom"):
        load_user_function(f"{tmp_path}/bad.py:f")
