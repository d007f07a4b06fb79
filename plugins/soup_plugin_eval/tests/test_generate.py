"""`soup generate` gives, token for token, what plain transformers `generate` (peft's PeftModel for an adapter)
gives on the same model, prompts, template, batch and padding: for an adapter, a checkpoint, a merged folder
and a full model. First, each time, the trained model's greedy tokens differ from the base's, so the weights
really are the trained ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from eval_kit import Runs, invoke, sums

from soup_plugin_eval.cli import generate

PROMPTS = sums(5, start=20)  # not trained on; lengths differ, so a batch of 3 is left-padded
BATCH, NEW = 3, 12


def plain_generate(model_dir: Path, tokenizer_dir: Path, adapter: Path | None = None) -> list[list[int]]:
    """The reference: transformers (and peft) by hand, batched with left padding, greedy."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    eos = model.generation_config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos])
    out: list[list[int]] = []
    for start in range(0, len(PROMPTS), BATCH):
        texts = [tokenizer.apply_chat_template(row["messages"][:1], tokenize=False, add_generation_prompt=True)
                 for row in PROMPTS[start:start + BATCH]]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            generated = model.generate(**batch, max_new_tokens=NEW, do_sample=False,
                                       pad_token_id=tokenizer.pad_token_id)
        for row in generated[:, batch["input_ids"].shape[1]:].tolist():
            ids = []
            for token in row:
                ids.append(token)
                if token in stops:
                    break
            out.append(ids)
    return out


def soup_generate(target: Path | str, tmp_path: Path, *extra: str) -> list[list[int]]:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS), encoding="utf-8")
    preds = tmp_path / "preds.jsonl"
    result = invoke(generate, [str(target), "--input", str(data), "--output", str(preds), "--batch-size",
                               str(BATCH), "--max-new-tokens", str(NEW), *extra])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in preds.read_text(encoding="utf-8").splitlines()]
    assert [r["index"] for r in records] == list(range(len(PROMPTS)))
    assert [r["reference"] for r in records] == [row["messages"][1]["content"] for row in PROMPTS]
    return [r["tokens"] for r in records]


@pytest.fixture(scope="module")
def base_tokens(runs: Runs, tiny_model: Path) -> list[list[int]]:
    return plain_generate(tiny_model, runs.lora.output_dir)  # the base, prompted with the run's tokenizer


def test_adapter(in_home: Runs, base_tokens, tmp_path: Path) -> None:
    out = in_home.lora.output_dir
    expected = plain_generate(in_home.lora.start.config.base, out, adapter=out)
    assert expected != base_tokens  # the adapter changes the answers: the test below can fail
    assert soup_generate(out, tmp_path) == expected
    assert soup_generate(in_home.lora.run_id, tmp_path) == expected  # a run id names the same output
    assert soup_generate(in_home.lora.run_id[:-3], tmp_path) == expected  # so does a unique prefix


def test_checkpoint(in_home: Runs, base_tokens, tmp_path: Path) -> None:
    out = in_home.lora.output_dir
    checkpoint = out / "checkpoint-1"
    expected = plain_generate(in_home.lora.start.config.base, out, adapter=checkpoint)
    assert expected != base_tokens
    assert expected != plain_generate(in_home.lora.start.config.base, out, adapter=out)  # step 1, not step 3
    assert soup_generate(checkpoint, tmp_path) == expected


def test_merged(in_home: Runs, base_tokens, tmp_path: Path) -> None:
    from soup_core.default_plugins.transformers import merge_adapter

    out = in_home.lora.output_dir
    merged = merge_adapter(in_home.lora.start.config.base, out, tmp_path / "merged")
    expected = plain_generate(merged, merged)
    assert expected != base_tokens
    assert soup_generate(merged, tmp_path) == expected


def test_full_model_and_latest(in_home: Runs, base_tokens, tmp_path: Path) -> None:
    out = in_home.full.output_dir
    expected = plain_generate(out, out)
    assert expected != base_tokens
    assert soup_generate("latest", tmp_path) == expected  # the full run is the newest


def test_typed_prompts_to_stdout(in_home: Runs) -> None:
    """--prompt in a chat run is a user turn through the chat template; stdout holds the text only."""
    out = in_home.lora.output_dir
    rows = [[r["messages"][0]] for r in PROMPTS[:2]]
    result = invoke(generate, [str(out), "-p", rows[0][0]["content"], "-p", rows[1][0]["content"],
                               "--max-new-tokens", str(NEW), "--batch-size", "3"])
    assert result.exit_code == 0, result.output
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    expected = plain_generate(in_home.lora.start.config.base, out, adapter=out)[:2]
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in expected]
    assert result.stdout == "".join(text + "\n" for text in texts)


def test_sampling_is_seeded(in_home: Runs, tmp_path: Path) -> None:
    out = in_home.lora.output_dir
    first = soup_generate(out, tmp_path, "--temperature", "1.5", "--seed", "3")
    assert soup_generate(out, tmp_path, "--temperature", "1.5", "--seed", "3") == first
    assert soup_generate(out, tmp_path, "--temperature", "1.5", "--seed", "4") != first  # control


@pytest.mark.parametrize(("args", "code", "message"), [
    ([], 2, "give --prompt"),
    (["-p", "x", "--top-p", "0.5"], 2, "needs --temperature"),
    (["-p", "x", "--input", "rows.jsonl"], 2, "not both"),
    (["--input", "missing.jsonl"], 1, "no such file"),
])
def test_usage_errors(in_home: Runs, args: list[str], code: int, message: str, tmp_path: Path,
                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = invoke(generate, [str(in_home.lora.output_dir), *args])
    assert result.exit_code == code and message in result.output, result.output
    assert "Traceback" not in result.output


def test_not_a_run(tmp_path: Path, in_home: Runs) -> None:
    (tmp_path / "config.json").write_text("{}", encoding="utf-8")
    result = invoke(generate, [str(tmp_path), "-p", "x"])
    assert result.exit_code == 1 and "holds no Soup run" in result.output, result.output
    result = invoke(generate, ["run_nope", "-p", "x"])
    assert result.exit_code == 1 and "no run matches it" in result.output, result.output


def test_typed_prompt_in_a_plain_run_is_the_prompt_tokens(in_home: Runs, tmp_path: Path) -> None:
    """A run that trained on prompt/completion rows gets the prompt's tokens as training tokenised them, no chat
    template (the card names the format; the folder is a copy no tracker knows)."""
    import shutil

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path / "plain"
    shutil.copytree(in_home.lora.output_dir, folder, ignore=shutil.ignore_patterns("checkpoint-*"))
    card = (folder / "README.md").read_text(encoding="utf-8")
    (folder / "README.md").write_text(card.replace("| chat |", "| prompt_completion |"), encoding="utf-8")
    (folder / ".soup_run.json").unlink()
    result = invoke(generate, [str(folder), "-p", "what is 20 plus 20?", "--max-new-tokens", str(NEW)])
    assert result.exit_code == 0, result.output

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(in_home.lora.start.config.base,
                                                                           dtype=torch.float32), folder).eval()
    plain = tokenizer("what is 20 plus 20?", return_tensors="pt")  # add_special_tokens, as training's prompt
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "what is 20 plus 20?"}],
                                         add_generation_prompt=True, return_tensors="pt", return_dict=True)
    texts = []
    for batch in (plain, chat):
        with torch.inference_mode():
            out = model.generate(**batch, max_new_tokens=NEW, do_sample=False)
        texts.append(tokenizer.decode(out[0, batch["input_ids"].shape[1]:], skip_special_tokens=True))
    assert texts[0] != texts[1]  # the template matters, so the test can fail
    assert result.stdout == texts[0] + "\n"
