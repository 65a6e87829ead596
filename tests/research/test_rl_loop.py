"""examples/rl_loop.py at tiny sizes: the GRPO loop trains the engine's own arrays, hands them
back with no copy and no engine compile, and the weights and greedy outputs change; the
trainer's forward agrees with the engine's sampled-token logprobs."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("optax")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rl_loop.py"


@pytest.mark.slow  # an optax step compiles on CPU
def test_rl_loop_changes_weights_and_outputs(tiny_llama_dir):
    spec = importlib.util.spec_from_file_location("rl_loop", EXAMPLE)
    rl_loop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rl_loop)
    lines = []
    res = rl_loop.run(str(tiny_llama_dir), steps=2, num_prompts=2, group=4, max_tokens=8,
                      prompt_len=6, lr=1e-2, engine_kwargs=dict(max_num_seqs=8,
                                                                max_num_batched_tokens=32,
                                                                min_token_bucket=8,
                                                                max_model_len=64),
                      log=lines.append)
    assert res["weights_changed"] and res["outputs_changed"]
    assert res["engine_compiles_in_loop"] == 0
    for rec in res["steps"]:
        assert rec["copied_tensors"] == 0  # the optax step's arrays are used as they are
        assert rec["logprob_gap"] < 1e-4  # float32: the trainer scores what the engine sampled
        assert min(rec["sample_s"], rec["train_s"], rec["update_s"]) > 0
    assert len(lines) == 3 and "update_weights" in lines[0] and "train" in lines[0]
