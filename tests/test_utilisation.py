"""The practical peak behind the utilisation line: its precision on a device that only emulates a
half precision, and how many rounds it times (``app.engine.utilisation``)."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY

from app.config import load_config
from app.engine import utilisation
from app.precision.hardware import Capabilities

CPU = torch.device("cpu")


def caps(native_bf16: bool) -> Capabilities:
    return Capabilities("cpu", "test CPU", "AVX2", native_bf16=native_bf16, native_fp16=False)


@pytest.mark.parametrize(
    ("native", "dtype", "expected"),
    [
        (False, torch.bfloat16, None),  # emulated: the peak is fp32's
        (True, torch.bfloat16, torch.bfloat16),
        (False, torch.float16, None),
        (False, None, None),  # an fp32 run
    ],
)
def test_the_peak_is_measured_in_fp32_where_the_half_precision_is_emulated(
    monkeypatch, native, dtype, expected
):
    monkeypatch.setattr(utilisation, "detect", lambda device: caps(native))
    assert utilisation.peak_dtype(CPU, dtype) == expected


def test_an_emulated_bf16_run_reports_its_step_against_the_fp32_peak(monkeypatch, tmp_path):
    monkeypatch.setenv("IRONGRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(utilisation, "detect", lambda device: caps(False))
    measured = []

    def fake_peak(device, dtype, channels_last):
        measured.append(dtype)
        return 100e9

    monkeypatch.setattr(utilisation, "measure_peak", fake_peak)
    cfg = load_config([*TINY, "--opt-level", "O1", "--amp-dtype", "bfloat16"])
    use = utilisation.Utilisation.for_run(cfg, CPU, "bf16 autocast, channels_last")
    assert measured == [None] and use.emulated
    line = use.describe(step_s=use.step_flop / 1e9)  # 1 GFLOP/s: 1% of the peak
    assert "peak is fp32's (this device has no native bf16): 100 GFLOP/s" in line
    assert line.endswith("runs at 1 GFLOP/s, 1% of it")
    # cached under fp32's facts: an fp32 run on this device reads the same figure
    fp32_cfg = load_config([*TINY, "--opt-level", "O0"])
    fp32 = utilisation.Utilisation.for_run(fp32_cfg, CPU, "fp32, channels_last")
    assert measured == [None] and not fp32.emulated and fp32.peak_flop_per_s == 100e9
    assert "peak in fp32, channels_last is 100 GFLOP/s" in fp32.describe()


@pytest.mark.parametrize(
    ("seconds", "max_rounds", "timed"),
    [(0.0, 100, utilisation.PEAK_MIN_ROUNDS), (1e9, 7, 7)],
)
def test_the_peak_is_the_best_of_its_minimum_rounds_or_a_second_at_most_its_cap(
    monkeypatch, seconds, max_rounds, timed
):
    monkeypatch.setitem(utilisation.PEAK_INPUT, "cpu", (1, 4, 4, 4, 4))
    monkeypatch.setattr(utilisation, "PEAK_SECONDS", seconds)
    monkeypatch.setattr(utilisation, "PEAK_MAX_ROUNDS", max_rounds)
    calls = []
    monkeypatch.setattr(utilisation, "synchronize", calls.append)
    assert utilisation.measure_peak(CPU, None, channels_last=True) > 0
    assert len(calls) == 2 * (1 + timed)  # a warm-up, then the timed rounds
