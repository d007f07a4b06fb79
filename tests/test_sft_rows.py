"""Per-row statistics and row order of the transformers backend's sft trainer (docs/architecture.md).

Every micro-batch event must carry the core's rows, and each row's loss and supervised-token count must
add up to the loss the trainer back-propagates. Both are checked against independent channels: the
model's own logits on the same batch (recomputed in the test), and the token ids that reach the model's
forward, decoded back to the row numbers written into each row's text.
"""

from __future__ import annotations

import math
import re

import pytest

pytestmark = pytest.mark.slow


def _rows_with_empty_one(make_chat_rows, n: int = 10):
    rows = make_chat_rows(n)
    # A user turn longer than max_length (64): truncation leaves this row no assistant token to train on.
    rows.append(
        {
            "messages": [
                {"role": "user", "content": f"row {n} rambles: " + " ".join(["word"] * 120)},
                {"role": "assistant", "content": "never seen"},
            ]
        }
    )
    return rows


def _spy_on_compute_loss(trainer, torch):
    """Record, for every training micro-batch: its rows, the trainer's loss and normaliser, and per-row
    losses computed independently from the model's logits on the same inputs and weights."""
    records = []
    original = trainer.compute_loss
    functional = torch.nn.functional

    def spy(model, inputs, return_outputs=False, num_items_in_batch=None):
        rows = inputs["row_index"].tolist()
        labels = inputs["labels"]
        position_ids = inputs.get("position_ids")
        with torch.no_grad():
            plain = {k: inputs[k] for k in ("input_ids", "attention_mask", "position_ids") if k in inputs}
            logits = trainer.model(**plain, use_cache=False).logits.float()
        loss = original(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        shifted = labels[:, 1:]
        ce = functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)), shifted.reshape(-1), ignore_index=-100, reduction="none"
        ).view(shifted.shape)
        mask = shifted != -100
        if position_ids is None:
            sums, counts = ce.sum(1), mask.sum(1)
        else:
            # packed: a new row starts wherever the position ids restart at 0
            segment = (position_ids[0] == 0).long().cumsum(0) - 1
            target_segment = segment[1:]
            sums = torch.zeros(len(rows)).index_add_(0, target_segment, ce[0])
            counts = torch.zeros(len(rows), dtype=torch.long).index_add_(0, target_segment, mask[0].long())
        independent = {
            row: (float(s) / int(c) if int(c) else math.nan, int(c))
            for row, s, c in zip(rows, sums.tolist(), counts.tolist(), strict=True)
        }
        norm = int(num_items_in_batch) if num_items_in_batch is not None else None
        records.append({"rows": rows, "loss": float(loss.detach()), "norm": norm, "independent": independent})
        return loss

    trainer.compute_loss = spy
    return records


def _rows_match(rows, losses, tokens, independent, *, rel=1e-5) -> bool:
    """Does every row's (loss, tokens) equal the independent computation for that row index?"""
    for row, loss, count in zip(rows, losses, tokens, strict=True):
        expected_loss, expected_count = independent[row]
        if count != expected_count:
            return False
        if math.isnan(expected_loss) or math.isnan(loss):
            if not (math.isnan(expected_loss) and math.isnan(loss)):
                return False
        elif not math.isclose(loss, expected_loss, rel_tol=rel, abs_tol=1e-6):
            return False
    return True


@pytest.mark.parametrize(
    ("grad_accum", "packing"),
    [(1, False), (2, False), (1, True), (2, True)],
    ids=["plain", "ga2", "packed", "packed-ga2"],
)
def test_row_losses_add_up_to_the_trainer_loss(sft_run, make_chat_rows, torch_one_thread, grad_accum, packing):
    torch = torch_one_thread
    rows = _rows_with_empty_one(make_chat_rows)
    run, recorder = sft_run(
        rows,
        data={"packing": packing, "on_bad_row": "skip"},  # the empty row stays, adding no loss
        training={
            "max_steps": 3 if grad_accum == 1 else 2,
            "gradient_accumulation_steps": grad_accum,
            "learning_rate": 5e-3,
            "lora": {"dropout": 0.0},  # the spy's extra forward must see the same function
        },
    )
    records = _spy_on_compute_loss(run.trainer, torch)
    run.run()

    events = recorder.micro
    assert len(events) == len(records) == 3  # 11 rows, batch 4: micro-batches of 4, 4, 3
    assert [(e.step, e.micro) for e in events] == (
        [(1, 0), (2, 0), (3, 0)] if grad_accum == 1 else [(1, 0), (1, 1), (2, 0)]
    )
    empty_seen = False
    for event, record in zip(events, records, strict=True):
        assert list(event.rows) == record["rows"]
        assert _rows_match(event.rows, event.row_loss, event.row_tokens, record["independent"])
        weighted = sum(loss * n for loss, n in zip(event.row_loss, event.row_tokens, strict=True) if n)
        # The trainer divides the micro-batch's summed token loss by the tokens of the whole step.
        assert record["norm"] == sum(sum(e.row_tokens) for e in events if e.step == event.step)
        assert math.isclose(weighted, record["loss"] * record["norm"], rel_tol=1e-5)
        independent_sum = sum(loss * n for loss, n in record["independent"].values() if n)
        assert math.isclose(weighted, independent_sum, rel_tol=1e-5)
        if 10 in event.rows:
            i = event.rows.index(10)
            assert event.row_tokens[i] == 0 and math.isnan(event.row_loss[i])
            empty_seen = True
    assert empty_seen, "the row without supervised tokens never came up"

    # Control: the same check rejects a wrong row mapping (two rows' statistics swapped).
    event = events[0]
    i, j = next(
        (a, b)
        for a in range(len(event.rows))
        for b in range(a + 1, len(event.rows))
        if event.row_tokens[a] and event.row_tokens[b] and abs(event.row_loss[a] - event.row_loss[b]) > 1e-3
    )
    swapped = list(event.rows)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    assert not _rows_match(swapped, event.row_loss, event.row_tokens, records[0]["independent"])


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_micro_batches_hold_the_cores_rows(sft_run, make_chat_rows, packing):
    from soup_core.data import micro_batches

    n_rows, batch = 10, 4
    run, recorder = sft_run(
        make_chat_rows(n_rows),
        data={"packing": packing, "seed": 7},
        training={"max_steps": None, "epochs": 2, "batch_size": batch, "gradient_accumulation_steps": 2},
    )
    tokenizer = run.setup.tokenizer
    seen: list[list[int]] = []

    def decode_rows(module, args, kwargs):
        if not module.training:
            return
        ids = kwargs["input_ids"]
        if "position_ids" in kwargs and "attention_mask" not in kwargs:
            starts = (kwargs["position_ids"][0] == 0).nonzero().flatten().tolist() + [ids.size(1)]
            pieces = [ids[0, a:b] for a, b in zip(starts, starts[1:], strict=False)]
        else:
            pieces = [ids[k][kwargs["attention_mask"][k].bool()] for k in range(ids.size(0))]
        seen.append([int(re.search(r"row (\d+)", tokenizer.decode(p)).group(1)) for p in pieces])

    run.trainer.model.register_forward_pre_hook(decode_rows, with_kwargs=True)
    summary = run.run()

    expected = [mb for epoch in range(2) for mb in micro_batches(n_rows, batch_size=batch, epoch=epoch, seed=7)]
    assert seen == expected
    assert [list(e.rows) for e in recorder.micro] == expected
    assert summary["steps"] == 4  # 3 micro-batches per epoch, 2 per step: steps of 2 and 1, twice
    # Control: a different data seed gives a different order, so the comparison is not vacuous.
    other = [mb for epoch in range(2) for mb in micro_batches(n_rows, batch_size=batch, epoch=epoch, seed=8)]
    assert other != expected


def test_packed_row_losses_equal_unpacked_ones(sft_run, make_chat_rows):
    """Packing must not let rows attend to each other: at the first step (same weights), each row's loss
    is the same packed or padded."""
    rows = make_chat_rows(8)
    losses = {}
    for packing in (False, True):
        run, recorder = sft_run(rows, data={"packing": packing}, training={"max_steps": 1, "lora": {"dropout": 0.0}})
        run.run()
        event = recorder.micro[0]
        losses[packing] = dict(zip(event.rows, zip(event.row_loss, event.row_tokens, strict=True), strict=True))
    assert losses[False].keys() == losses[True].keys()
    for row, (loss, tokens) in losses[False].items():
        packed_loss, packed_tokens = losses[True][row]
        assert tokens == packed_tokens
        assert math.isclose(loss, packed_loss, rel_tol=1e-5)


def test_per_row_work_is_skipped_without_recorders(sft_run, make_chat_rows, monkeypatch):
    import soup_core.default_plugins.transformers.trainer as trainer_module

    calls = []
    real = trainer_module.row_sums
    monkeypatch.setattr(trainer_module, "row_sums", lambda *a, **k: calls.append(1) or real(*a, **k))

    run, _ = sft_run(make_chat_rows(8), training={"max_steps": 2}, recorders=[])
    assert run.ctx.events.has_recorders is False
    assert run.run()["steps"] == 2
    assert calls == []

    run, recorder = sft_run(make_chat_rows(8), training={"max_steps": 2})  # control: with a recorder
    run.run()
    assert len(calls) == 2 and len(recorder.micro) == 2
