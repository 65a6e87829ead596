"""Adapter files are bounded before they are read (jaxserve.loaders.peft): regular files only,
sizes checked first, paths under --lora-allowed-paths, weights finite; every refusal a
``LoRAAdapterError`` written for the user. Host only, no device."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jaxserve.loaders.peft import LoRAAdapterError, LoRATargets, load_peft_adapter
from jaxserve.testing.lora_adapters import write_random_adapter

SHAPES = {"model.layers.0.self_attn.q_proj": (16, 16), "model.layers.0.self_attn.v_proj": (16, 8)}
TARGETS = LoRATargets(SHAPES)


def _load(path, allowed=None, name="a"):
    return load_peft_adapter(name, str(path), TARGETS, 8, allowed)


@pytest.fixture
def good(tmp_path):
    return write_random_adapter(tmp_path / "ok" / "good", SHAPES, r=4,
                                target_modules=["q_proj", "v_proj"])


def test_good_adapter_loads_under_its_allowed_root(good, tmp_path):
    ad = _load(good, [tmp_path / "ok"])
    assert ad.rank == 4 and set(ad.weights) == set(SHAPES)


def _refused(path, match, allowed=None):
    with pytest.raises(LoRAAdapterError, match=match) as e:
        _load(path, allowed)
    for leak in ("Errno", "Traceback", "object has no attribute"):
        assert leak not in e.value.message
    return e.value.message


def test_outside_the_allow_list_says_the_same_whether_it_exists(good, tmp_path):
    allowed = [tmp_path / "elsewhere"]
    a = _refused(good, "not under an allowed path", allowed)
    b = _refused(tmp_path / "missing", "not under an allowed path", allowed)
    assert a == b
    link = tmp_path / "elsewhere"
    link.mkdir()
    (link / "escape").symlink_to(good)  # a symlink inside resolves outside: refused
    _refused(link / "escape", "not under an allowed path", allowed)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "big", "list", "dir"])
def test_hostile_config_files(good, kind):
    cfg = good / "adapter_config.json"
    cfg.unlink()
    if kind == "fifo":
        os.mkfifo(cfg)
        _refused(good, "adapter_config.json is not a regular file")
    elif kind == "dev-zero":
        cfg.symlink_to("/dev/zero")
        _refused(good, "adapter_config.json is not a regular file")
    elif kind == "big":
        with open(cfg, "wb") as f:
            f.truncate(2**30)
        _refused(good, "more than the limit of 1048576")
    elif kind == "list":
        cfg.write_text("[1, 2]")
        _refused(good, "must hold a JSON object")
    else:
        cfg.mkdir()
        _refused(good, "adapter_config.json is not a regular file")


def test_weights_larger_than_the_rank_needs_are_refused_unread(good):
    w = good / "adapter_model.safetensors"
    with open(w, "ab") as f:
        f.truncate(w.stat().st_size + 2**22)
    _refused(good, "adapter_model.safetensors is .* more than the limit")


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_weights_name_the_tensor(good, bad):
    from safetensors.numpy import load_file, save_file

    w = good / "adapter_model.safetensors"
    t = load_file(str(w))
    key = "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight"
    t[key][1, 2] = bad
    save_file(t, str(w))
    msg = _refused(good, "holds NaN or infinite values")
    assert key in msg


def test_bad_alpha_and_header(good):
    cfg = json.loads((good / "adapter_config.json").read_text())
    (good / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": "big"}))
    _refused(good, "lora_alpha must be a finite number")
    (good / "adapter_config.json").write_text(json.dumps(cfg))
    (good / "adapter_model.safetensors").write_bytes((10**9).to_bytes(8, "little") + b"{}")
    _refused(good, "not a safetensors file")
