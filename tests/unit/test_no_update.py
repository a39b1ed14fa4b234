"""Steps without an optimizer step: why, and the watch that says so and stops the run."""

import logging

from hybrid_rl.trainer.no_update import NoUpdateWatch, no_update_reason


def test_reason_names_the_cause():
    dapo = {"dapo/skipped_updates": 1.0, "dapo/prompts_drawn": 12.0, "dapo/gen_rounds": 3.0, "critic/score/mean": 1.0}
    assert "12 groups drawn in 3" in no_update_reason(dapo, 0, 0)
    assert "non-finite" in no_update_reason({"actor/optimizer_steps": 2.0}, 5, 7)
    assert no_update_reason({"actor/optimizer_steps": 2.0}, 5, 6) == ""  # one of two steps updated
    assert no_update_reason({"actor/optimizer_steps": 1.0}, 0, 0) == ""


def test_watch_logs_every_skip_warns_once_and_resets(caplog):
    watch = NoUpdateWatch(patience=2, action="warn", is_main=True)
    with caplog.at_level(logging.WARNING, logger="hybrid_rl"):
        out = [watch.observe(s, "why") for s in (1, 2, 3)]
    assert [m["trainer/no_update_streak"] for m in out] == [1.0, 2.0, 3.0]
    text = caplog.text
    assert "step 1: no update" in text and "step 3: no update" in text
    assert text.count("steps in a row without an update") == 1 and not watch.must_stop
    assert watch.observe(4, "")["trainer/no_update"] == 0.0 and watch.streak == 0


def test_watch_stops_at_patience_and_never_with_zero():
    stop = NoUpdateWatch(patience=2, action="stop", is_main=False)
    stop.observe(1, "why")
    assert not stop.must_stop
    stop.observe(2, "why")
    assert stop.must_stop and "trainer.no_update_patience=2" in stop.message()
    never = NoUpdateWatch(patience=0, action="stop", is_main=False)
    for s in range(10):
        never.observe(s, "why")
    assert not never.must_stop


def test_switch_notes_are_said_once(caplog):
    """A switch note (a setting without effect on this hardware) is one line, not one per step."""
    from hybrid_rl.hybrid.switch import SwitchReport
    from hybrid_rl.trainer.step_metrics import NotesOnce

    notes = NotesOnce(is_main=True)
    report = SwitchReport("to_train", {}, {}, 0, notes=["engine has no sleep mode here"])
    with caplog.at_level(logging.INFO, logger="hybrid_rl"):
        for _ in range(3):
            assert notes(report) is report
    assert caplog.text.count("engine has no sleep mode here") == 1


def test_an_offline_run_says_when_its_epochs_end_before_total_steps(caplog):
    from types import SimpleNamespace

    from hybrid_rl.trainer.offline import offline_steps

    cfg = SimpleNamespace(
        trainer=SimpleNamespace(total_steps=1000, sft_epochs=1.0, task="dpo"), data=SimpleNamespace(train_batch_size=32)
    )
    with caplog.at_level(logging.INFO, logger="hybrid_rl"):
        assert offline_steps(cfg, 2700) == 84
    assert "training 84 steps, not trainer.total_steps=1000" in caplog.text and "dpo writes no checkpoints" in caplog.text
