"""The KV budget when the engine could not set JAX's allocator fraction (JAX started first, as
beside a trainer in the same process): ``F x total - in use - reserve``, with one log line
saying so; the allocator's limit cuts it with a warning, never silently."""
from __future__ import annotations

import logging

import pytest

from jaxserve.worker import memory_budget

GiB = 2**30


def _budget(caplog, fraction, source, util=0.9, in_use=30 * GiB, total=80 * GiB):
    stats = {"bytes_limit": int(fraction * total), "bytes_in_use": in_use}
    with caplog.at_level(logging.INFO, logger=memory_budget.__name__):
        caplog.clear()
        out = memory_budget.kv_cache_budget_from_stats(stats, util, GiB, 0, fraction=fraction,
                                                       source=source)
    return out, [r for r in caplog.records if r.name == memory_budget.__name__]


def test_started_first_sizes_from_utilization_of_total_minus_in_use(caplog):
    # a trainer holds 30 GiB; JAX's allocator took 0.95 of 80 GiB; utilization 0.5
    (budget, total, in_use), logs = _budget(caplog, 0.95, "started", util=0.5)
    assert total == pytest.approx(80 * GiB, rel=1e-6) and in_use == 30 * GiB
    assert budget == pytest.approx(0.5 * 80 * GiB - 30 * GiB - GiB, rel=1e-6)
    assert len(logs) == 1 and logs[0].levelno == logging.INFO
    assert "JAX started before the engine" in logs[0].getMessage()
    assert "gpu_memory_utilization 0.50" in logs[0].getMessage()


def test_limit_below_utilization_is_a_warning_naming_the_fix(caplog):
    (budget, _, _), logs = _budget(caplog, 0.75, "started", util=0.9)
    assert budget == pytest.approx(0.75 * 80 * GiB - 30 * GiB - GiB, rel=1e-6)
    assert len(logs) == 1 and logs[0].levelno == logging.WARNING
    msg = logs[0].getMessage()
    assert "capped by the allocator's limit" in msg and "XLA_PYTHON_CLIENT_MEM_FRACTION=0.90" in msg


def test_fraction_set_by_the_engine_logs_nothing(caplog):
    (budget, _, _), logs = _budget(caplog, 0.9, "engine", util=0.9)
    assert budget == pytest.approx(0.9 * 80 * GiB - 30 * GiB - GiB, rel=1e-6)
    assert logs == []


def test_set_allocator_fraction_records_who_decided(monkeypatch):
    monkeypatch.setattr(memory_budget, "_fraction_source", None)  # restored after the test
    monkeypatch.setattr(memory_budget, "_backends_started", lambda: True)
    monkeypatch.delenv(memory_budget.ALLOCATOR_FRACTION_ENV, raising=False)
    assert memory_budget.set_allocator_fraction(0.9) == memory_budget.JAX_DEFAULT_FRACTION
    assert memory_budget.fraction_source() == "started"
    monkeypatch.setenv(memory_budget.ALLOCATOR_FRACTION_ENV, "0.6")
    assert memory_budget.set_allocator_fraction(0.9) == 0.6
    assert memory_budget.fraction_source() == "env"
    monkeypatch.setattr(memory_budget, "_backends_started", lambda: False)
    monkeypatch.delenv(memory_budget.ALLOCATOR_FRACTION_ENV)
    assert memory_budget.set_allocator_fraction(0.85) == pytest.approx(0.85)
    assert memory_budget.fraction_source() == "engine"
