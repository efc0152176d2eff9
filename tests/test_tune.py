"""mtp-tune's verdict and what it stores, from measurements a machine could give."""

import json

import pytest

from mtp_serve.cli.tune import Measurement, ModeRun, save_choice, table, verdict
from mtp_serve.models.model_card import load_card


def measurement(speeds, acceptance, identical=True, noisy=False):
    """Plain at 100 tok/s; depth d at speeds[d-1] x, accepting acceptance[d-1] of each position's drafts."""
    modes = {0: ModeRun(0, tokens={0: 100}, seconds={0: [1.0, 2.0 if noisy else 1.0]}, passes=200, runs=2,
                        outputs={0: [1, 2, 3]})}
    for d, (speed, acc) in enumerate(zip(speeds, acceptance), start=1):
        modes[d] = ModeRun(d, tokens={0: 100}, seconds={0: [1.0 / speed] * 2}, passes=100, runs=2, drafted=[50] * d,
                           accepted=[int(50 * acc)] * d, outputs={0: [1, 2, 3] if identical else [1, 2, 4]})
    return Measurement(modes, max_tokens=32, repeats=2)


def test_faster_depth_is_chosen():
    m = measurement([1.3, 1.7, 1.5], [0.8, 0.8, 0.8])
    v = verdict(m)
    assert v.depth == 2 and v.text == "depth 2: 1.70x plain, use it" and not v.broken and not v.notes
    assert "depth 2  170.0     1.70x         2.00  0.80 0.80" in table(m)


def test_slower_mtp_is_left_off():
    v = verdict(measurement([0.9, 0.8], [0.7, 0.7]))
    assert v.depth == 0 and v.text.startswith("MTP is slower here") and "leave it off" in v.text


def test_zero_acceptance_is_a_broken_head_not_a_slow_machine():
    v = verdict(measurement([0.6, 0.5], [0.0, 0.0]))
    assert v.broken and v.depth == 0
    assert "broken" in v.text and "not a slow machine" in v.text and "shifted twice" in v.text and "quantized" in v.text


def test_low_acceptance_differing_output_and_a_busy_machine_are_noted():
    v = verdict(measurement([1.1], [0.1], identical=False, noisy=True))
    assert any("only 0.10" in n for n in v.notes) and any("differed from plain" in n for n in v.notes)
    assert any("differed by up to 2.0x" in n and "busy" in n for n in v.notes)


def test_choice_is_stored_for_mtp_serve(tmp_path):
    (tmp_path / "mtp_serve.json").write_text(json.dumps({"mtp_hidden": "pre_norm"}))
    m = measurement([1.3, 1.7], [0.8, 0.8])
    save_choice(tmp_path, verdict(m), m, window_costs={4: 1.2, 32: 3.5})
    card = load_card("qwen3_5", tmp_path)
    assert card.default_mtp_depth == 2 and card.mtp_hidden == "pre_norm"  # other overrides kept
    stored = json.loads((tmp_path / "mtp_serve.json").read_text())
    assert stored["mtp_tune"]["speed_vs_plain"] == {"1": 1.3, "2": 1.7}
    assert stored["window_costs"] == {"4": 1.2, "32": 3.5} and card.window_costs == ((4, 1.2), (32, 3.5))


def test_window_costs_that_are_not_a_mapping_of_sizes_are_refused(tmp_path):
    (tmp_path / "mtp_serve.json").write_text(json.dumps({"window_costs": {"four": 1.2}}))
    with pytest.raises(ValueError, match="window_costs must map window sizes"):
        load_card("qwen3_5", tmp_path)
