"""EngineConfig: platform defaults resolved once, into a new config."""
from __future__ import annotations

from jaxserve.config import PLATFORM_SCHEDULER_DEFAULTS, engine_config_from_kwargs


def test_platform_fills_only_the_limits_left_unset_and_mutates_nothing():
    given = engine_config_from_kwargs("m", max_num_seqs=7)
    assert set(given.scheduler.backend_defaults) == {
        "max_num_batched_tokens", "min_token_bucket", "token_bucket_growth"}
    for platform in ("cpu", "gpu"):
        resolved = given.for_platform(platform)
        want = PLATFORM_SCHEDULER_DEFAULTS[platform]
        assert resolved.scheduler.max_num_seqs == 7
        assert resolved.scheduler.max_num_batched_tokens == want["max_num_batched_tokens"]
        assert resolved.scheduler.min_token_bucket == want["min_token_bucket"]
        assert resolved.scheduler.backend_defaults == ()
        assert resolved.attention_backend == ("pallas" if platform == "gpu" else "xla")
    assert given.scheduler.backend_defaults and given.attention_backend == "auto"
    assert given.for_platform("cpu").for_platform("gpu").scheduler.max_num_batched_tokens == \
        PLATFORM_SCHEDULER_DEFAULTS["cpu"]["max_num_batched_tokens"]  # resolved once
    explicit = engine_config_from_kwargs("m", attention_backend="reference").for_platform("gpu")
    assert explicit.attention_backend == "reference"
