"""`soup chat` with piped input: one answer per line, each the plain generate of the conversation so far (the
history is really kept, and /reset really forgets it), exit 0 at the end of the input. Sampled (seeded):
the tiny model's greedy answers hardly depend on the history, its sampled ones do."""

from __future__ import annotations

from eval_kit import Runs, invoke

from soup_plugin_eval.chat import chat

NEW = 10


def plain_answer(runs: Runs, messages: list[dict]) -> str:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = runs.lora.output_dir
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(runs.lora.start.config.base,
                                                                           dtype=torch.float32), out).eval()
    batch = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                          return_dict=True)
    from transformers import set_seed

    set_seed(0)  # soup chat's default --seed, set before each answer
    with torch.inference_mode():
        generated = model.generate(**batch, max_new_tokens=NEW, do_sample=True, temperature=1.0, top_p=1.0)
    return tokenizer.decode(generated[0, batch["input_ids"].shape[1]:], skip_special_tokens=True)


def test_piped_lines_get_one_answer_each(in_home: Runs) -> None:
    q1, q2, q3 = "what is 20 plus 20?", "what is 7 plus 7?", "what is 21 plus 21?"
    result = invoke(chat, [str(in_home.lora.output_dir), "--max-new-tokens", str(NEW), "--system", "Be brief.",
                                  "--temperature", "1"],
                    input=f"{q1}\n\n{q2}\n/reset\n{q3}\n")
    assert result.exit_code == 0, result.output
    system = [{"role": "system", "content": "Be brief."}]
    a1 = plain_answer(in_home, system + [{"role": "user", "content": q1}])
    a2 = plain_answer(in_home, system + [{"role": "user", "content": q1}, {"role": "assistant", "content": a1},
                                         {"role": "user", "content": q2}])
    a3 = plain_answer(in_home, system + [{"role": "user", "content": q3}])
    assert a2 != plain_answer(in_home, system + [{"role": "user", "content": q2}])  # the history matters
    assert result.stdout == "".join(a.replace("\n", " ") + "\n" for a in (a1, a2, a3))


def test_exit_stops_reading(in_home: Runs) -> None:
    result = invoke(chat, [str(in_home.lora.output_dir), "--max-new-tokens", "2"], input="/exit\nwhat is 1 plus 1?\n")
    assert result.exit_code == 0 and result.stdout == "", result.output


def test_refuses_a_run_not_trained_on_chat(in_home: Runs, tmp_path) -> None:
    import shutil

    folder = tmp_path / "plain"
    shutil.copytree(in_home.lora.output_dir, folder, ignore=shutil.ignore_patterns("checkpoint-*"))
    card = (folder / "README.md").read_text(encoding="utf-8")
    (folder / "README.md").write_text(card.replace("| chat |", "| prompt_completion |"), encoding="utf-8")
    (folder / ".soup_run.json").unlink()  # not the tracked run: the card says what it trained on
    result = invoke(chat, [str(folder)], input="hi\n")
    assert result.exit_code == 1 and "use soup generate" in result.output, result.output
