"""Controller actions on the mlx backend: stop, roll back to a checkpoint, and a refused coefficient."""

from __future__ import annotations

import numpy as np
import pytest

from soup_core import Controller, Rollback, SetCoefficient, Stop

pytestmark = pytest.mark.slow


class At(Controller):
    name = "at"

    def __init__(self, step: int, action) -> None:
        self.step, self.action = step, action

    def on_step(self, event):
        return [self.action] if event.step == self.step else []


def test_stop_ends_the_run_as_stopped(run_backend, write_data) -> None:
    result = run_backend(
        "mlx", write_data(16), training={"max_steps": 4}, controllers=(At(2, Stop("enough")),)
    )
    assert result.summary["status"] == "stopped" and result.summary["stop_reason"] == "enough"
    assert result.summary["steps"] == 2 and result.capture.end.status == "stopped"
    assert "Stopping at step 2: enough" in result.lines
    assert (result.output / "adapters.safetensors").is_file()  # the adapter so far is saved


def test_rollback_restores_the_checkpoint(run_backend, write_data) -> None:
    import mlx.core as mx

    data = write_data(16)
    settings = {"max_steps": 3, "save_steps": 2, "learning_rate": 0.01}
    # a rollback after the last step puts checkpoint-2's weights back: the saved result equals
    # checkpoint-2, not the step-3 weights a run without the controller ends with
    plain = run_backend("mlx", data, training=settings)
    rolled = run_backend("mlx", data, training=settings, controllers=(At(3, Rollback(reason="spike")),))
    assert rolled.summary["steps"] == 3
    assert any(
        line.startswith("Rolled back model and optimizer to ") and line.endswith("(spike)")
        for line in rolled.lines
    )
    ckpt = mx.load(str(rolled.output / "checkpoint-2" / "adapters.safetensors"))
    final = mx.load(str(rolled.output / "adapters.safetensors"))
    for name, value in ckpt.items():
        assert np.array_equal(np.array(value), np.array(final[name])), name
    plain_final = mx.load(str(plain.output / "adapters.safetensors"))
    assert any(not np.array_equal(np.array(v), np.array(plain_final[k])) for k, v in final.items())


def test_rollback_without_checkpoint_and_coefficients_fail_clearly(run_backend, write_data) -> None:
    data = write_data(8)
    with pytest.raises(Exception, match="no checkpoint to roll back to; set training.save_steps"):
        run_backend("mlx", data, training={"max_steps": 2}, controllers=(At(1, Rollback()),))
    with pytest.raises(Exception, match="coefficient 'beta', which the sft trainer does not have"):
        run_backend("mlx", data, training={"max_steps": 2}, controllers=(At(1, SetCoefficient("beta", 0.1)),))
