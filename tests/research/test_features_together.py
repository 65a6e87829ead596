"""Every research feature in one engine (hidden states, prompt embeddings, jax and host logits
processors, built-ins, prompt logprobs, n > 1, a processor that raises): each step's inputs keep
one shape per bucket, so nothing compiles after warm-up whatever the mix of requests."""
import numpy as np
from safetensors.numpy import load_file

from jaxserve import LLM, SamplingParams
from processors import BanJax, Exploding

SMALL = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, min_token_bucket=32)


def _g(**kw):
    return SamplingParams(**{"temperature": 0, "max_tokens": 6, **kw})


def test_no_compile_after_warmup_with_every_feature_on(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), max_hidden_state_layers=3, enable_prompt_embeds=True,
              logits_processors=[BanJax, "processors:BanHost", Exploding], **SMALL)
    [path] = tiny_llama_dir.glob("*.safetensors")
    table = load_file(path)["model.embed_tokens.weight"].astype(np.float32)
    compiles = llm.llm_engine.stats()["num_compiles"]
    long = list(range(3, 80))  # chunked: the step budget is 32 tokens
    batches = [
        ([[1, 5, 9, 13], long], _g(logprobs=3)),
        ([{"prompt_embeds": table[[1, 5, 9]]}, [8, 8, 8]], _g(logprobs=3)),
        ([[1, 5, 9], long], [_g(extra_args={"return_hidden_states": [0, 1]}), _g()]),
        ([[1, 5, 9], [4, 4]], [_g(extra_args={"ban_jax": 5}), _g(extra_args={"ban_host": 6})]),
        ([{"prompt_embeds": table[long]}, [1, 2, 3]],
         [_g(extra_args={"return_hidden_states": [2], "ban_jax": 7}),
          _g(extra_args={"ban_host": 3}, logit_bias={5: -1e9}, min_tokens=3)]),
        ([{"prompt_embeds": table[long[:40]]}],
         _g(prompt_logprobs=2, extra_args={"return_hidden_states": [2]})),
        ([[1, 5, 9]], _g(extra_args={"explode": True})),
        ([[1, 5, 9]] * 3, _g(n=2, temperature=0.7, seed=3, min_p=0.2)),
    ]
    outs = [llm.generate(p, sp, use_tqdm=False) for p, sp in batches]
    assert outs[2][0].hidden_states.shape[1:] == (2, llm.llm_engine.model_config.hidden_size)
    assert 5 not in outs[3][0].outputs[0].token_ids
    assert outs[6][0].outputs[0].finish_reason == "abort"
    assert all(len(o.outputs) == 2 for o in outs[7])
    assert llm.llm_engine.stats()["num_compiles"] == compiles
