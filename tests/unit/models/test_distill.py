"""`meshserve distill` checkpoints: a resume restores weights, AdamW moments, schedule and RNG exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.models import distill as dist


def _run(steps: int, seed: int = 0) -> tuple[Any, Any, Any]:
    """A small model trained ``steps`` AdamW steps under a cosine schedule (deterministic)."""
    import torch
    from transformers import get_cosine_schedule_with_warmup

    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = get_cosine_schedule_with_warmup(optimizer, 1, 10)
    for _ in range(steps):
        loss = model(torch.randn(3, 8)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    return model, optimizer, schedule


def test_resume_restores_the_run_from_a_checkpoint_read_onto_the_cpu(tmp_path: Path) -> None:
    import torch
    from transformers import get_cosine_schedule_with_warmup

    model, optimizer, schedule = _run(3)
    dist._save_checkpoint(tmp_path, 3, model, optimizer, schedule, keep=2)
    saved_rng = torch.get_rng_state().clone()
    torch.manual_seed(1234)  # the resuming process starts from another RNG state

    fresh = torch.nn.Linear(8, 4)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_schedule = get_cosine_schedule_with_warmup(fresh_opt, 1, 10)
    latest = dist._latest_checkpoint(tmp_path)
    assert latest is not None and latest.name == "step-3.pt"
    assert dist._resume(latest, fresh, fresh_opt, fresh_schedule) == 3

    assert torch.equal(torch.get_rng_state(), saved_rng)
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
        moments = fresh_opt.state[b]
        assert moments["exp_avg"].device == b.device
        assert torch.equal(moments["exp_avg"], optimizer.state[a]["exp_avg"])
    assert fresh_schedule.get_last_lr() == schedule.get_last_lr()

    # Continuing the resumed run gives exactly what the uninterrupted run gives.
    torch.set_rng_state(saved_rng)
    x = torch.randn(3, 8)
    for m, opt, sched in ((model, optimizer, schedule), (fresh, fresh_opt, fresh_schedule)):
        opt.zero_grad()
        m(x).square().mean().backward()
        opt.step()
        sched.step()
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_step_log_starts_over_from_step_zero_and_appends_on_resume(tmp_path: Path) -> None:
    log = tmp_path / "distill.log"
    with dist._open_log(log, fresh=True) as handle:
        handle.write("1\t5.0\t1e-4\t0.1\n")
    with dist._open_log(log, fresh=False) as handle:
        handle.write("2\t4.0\t1e-4\t0.1\n")
    assert log.read_text().splitlines() == ["step\tloss\tlr\telapsed_s", "1\t5.0\t1e-4\t0.1", "2\t4.0\t1e-4\t0.1"]
    with dist._open_log(log, fresh=True) as handle:
        handle.write("1\t6.0\t1e-4\t0.1\n")
    assert log.read_text().splitlines() == ["step\tloss\tlr\telapsed_s", "1\t6.0\t1e-4\t0.1"]
