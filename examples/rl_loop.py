"""GRPO-style reinforcement learning with jaxserve and optax in one process, on one set of arrays.

Each step: sample a group of completions per prompt with the engine; score them with a toy
reward (the share of even token ids: easy to learn, easy to check); normalise the rewards within
each group (GRPO's advantage); one optax step of the policy gradient on the *engine's own*
params (``LLM.get_weights``: no copy); ``LLM.update_weights`` with the new arrays (used as
they are: placed like the engine's, so again no copy and no recompile); sample again. Every
phase's time is printed, and the gap between the engine's sampled-token logprobs and the
trainer's (the train / inference mismatch RL users watch).

    python examples/rl_loop.py                       # demo-random (a random tiny Llama)
    python examples/rl_loop.py --model /path/to/hf-llama --steps 20 --group 8

The trainer's forward below is a plain Llama (HF layout: ``[out, in]`` weights, rotate-half
RoPE, GQA, SwiGLU, RMSNorm); jaxserve's own forward is paged and lives inside its engine.
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxserve import LLM, SamplingParams


# ---- the trainer's forward: log-probabilities of given tokens ----------------------------

def _rms_norm(x, w, eps):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)).astype(x.dtype) * w


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    f = pos[..., None].astype(jnp.float32) * inv  # [B, T, D/2]
    cos, sin = jnp.cos(jnp.concatenate([f, f], -1)), jnp.sin(jnp.concatenate([f, f], -1))
    rot = jnp.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos[:, :, None] + rot * sin[:, :, None]


def _linear(p, name, x):
    y = x @ p[name + ".weight"].T
    return y + p[name + ".bias"] if name + ".bias" in p else y


def logits_of(p, cfg, tokens):
    """``tokens [B, T]`` -> ``[B, T, V]`` float32 logits (causal, positions 0..T-1)."""
    B, T = tokens.shape
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    x = p["model.embed_tokens.weight"][tokens]
    causal = jnp.tril(jnp.ones((T, T), bool))
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        h = _rms_norm(x, p[pre + "input_layernorm.weight"], cfg.rms_norm_eps)
        q = _rope(_linear(p, pre + "self_attn.q_proj", h).reshape(B, T, H, D), pos,
                  cfg.rope_theta)
        k = _rope(_linear(p, pre + "self_attn.k_proj", h).reshape(B, T, Hkv, D), pos,
                  cfg.rope_theta)
        v = _linear(p, pre + "self_attn.v_proj", h).reshape(B, T, Hkv, D)
        k, v = jnp.repeat(k, H // Hkv, 2), jnp.repeat(v, H // Hkv, 2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(D)
        a = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), -1).astype(v.dtype)
        o = jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(B, T, H * D)
        x = x + _linear(p, pre + "self_attn.o_proj", o)
        h = _rms_norm(x, p[pre + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        g = jax.nn.silu(_linear(p, pre + "mlp.gate_proj", h)) * _linear(p, pre + "mlp.up_proj", h)
        x = x + _linear(p, pre + "mlp.down_proj", g)
    x = _rms_norm(x, p["model.norm.weight"], cfg.rms_norm_eps)
    head = p.get("lm_head.weight", p["model.embed_tokens.weight"])
    return (x @ head.T).astype(jnp.float32)


def token_logprobs(p, cfg, tokens):
    """``[B, T-1]``: the logprob of each token given the ones before it."""
    lp = jax.nn.log_softmax(logits_of(p, cfg, tokens[:, :-1]), -1)
    return jnp.take_along_axis(lp, tokens[:, 1:, None], -1)[..., 0]


# ---- GRPO ---------------------------------------------------------------------------------

def toy_reward(token_ids) -> float:
    """The share of even token ids in a completion."""
    return float(np.mean(np.asarray(token_ids) % 2 == 0)) if len(token_ids) else 0.0


def group_advantages(rewards: np.ndarray) -> np.ndarray:
    """``[P, G]`` rewards -> advantages normalised within each prompt's group."""
    return (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, keepdims=True) + 1e-6)


def make_train_step(cfg, optimizer, shardings: dict):
    """One jitted optax step whose new params keep the engine's shardings (``shardings``), so
    ``update_weights`` takes them as they are and the next step sees the same input types."""
    def loss_fn(params, tokens, mask, adv):
        lp = token_logprobs(params, cfg, tokens)  # [B, T-1]
        per_seq = (lp * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1)
        return -(adv * per_seq).mean()

    @jax.jit
    def step(params, opt_state, tokens, mask, adv):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, mask, adv)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        new = jax.lax.with_sharding_constraint(optax.apply_updates(params, updates), shardings)
        return new, opt_state, loss

    return step


def _buffer(x) -> int:
    return x.addressable_data(0).unsafe_buffer_pointer()


def batch_of(outs, width: int):
    """(tokens [B, width], completion mask [B, width-1], engine logprobs [B, width-1],
    rewards [P, G]) of the sampled groups, right-padded with 0."""
    rows, masks, elps, rewards = [], [], [], []
    for out in outs:
        group = []
        for c in out.outputs:
            seq = list(out.prompt_token_ids) + list(c.token_ids)
            m = np.zeros(width - 1, np.float32)
            m[len(out.prompt_token_ids) - 1:len(seq) - 1] = 1.0
            e = np.zeros(width - 1, np.float32)
            for j, (t, d) in enumerate(zip(c.token_ids, c.logprobs or [])):
                e[len(out.prompt_token_ids) - 1 + j] = d[t].logprob
            rows.append(seq + [0] * (width - len(seq)))
            masks.append(m)
            elps.append(e)
            group.append(toy_reward(c.token_ids))
        rewards.append(group)
    return (np.asarray(rows, np.int32), np.stack(masks), np.stack(elps),
            np.asarray(rewards, np.float32))


def run(model: str = "demo-random", *, steps: int = 3, num_prompts: int = 4, group: int = 4,
        max_tokens: int = 16, prompt_len: int = 8, lr: float = 3e-3, seed: int = 0,
        engine_kwargs: dict | None = None, log=print) -> dict:
    """The loop; returns each step's times, rewards and logprob gap, and whether the weights and
    the outputs changed."""
    kw = dict(dtype="float32", max_model_len=prompt_len + max_tokens + 8)
    kw.update(engine_kwargs or {})
    llm = LLM(model, **kw)
    cfg = llm.llm_engine.model_config
    if cfg.rope_scaling or cfg.qk_norm or cfg.sliding_window:
        raise SystemExit("this example's trainer forward is a plain Llama (no rope scaling, "
                         "qk norm or sliding window)")
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, cfg.vocab_size, prompt_len).tolist() for _ in range(num_prompts)]
    probe = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    params = llm.get_weights()  # the engine's own arrays
    first = jax.tree_util.tree_map(np.asarray, params)
    greedy_before = [o.outputs[0].token_ids for o in llm.generate(prompts, probe, use_tqdm=False)]
    warm_compiles = llm.llm_engine.runner.num_compiles
    optimizer = optax.adam(lr)
    opt_state = optimizer.init(params)
    train = make_train_step(cfg, optimizer, {n: x.sharding for n, x in params.items()})
    score = jax.jit(lambda p, t: token_logprobs(p, cfg, t))
    width = prompt_len + max_tokens
    history = []
    for step in range(steps):
        t0 = time.perf_counter()
        sp = SamplingParams(n=group, temperature=1.0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=0, seed=seed + step)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        t1 = time.perf_counter()
        tokens, mask, engine_lp, rewards = batch_of(outs, width)
        adv = group_advantages(rewards).reshape(-1)
        trainer_lp = np.asarray(score(params, jnp.asarray(tokens)))
        gap = float(np.max(np.abs(trainer_lp - engine_lp) * mask))
        t2 = time.perf_counter()
        params, opt_state, loss = train(params, opt_state, jnp.asarray(tokens),
                                        jnp.asarray(mask), jnp.asarray(adv))
        jax.block_until_ready(params)
        t3 = time.perf_counter()
        llm.update_weights(params)
        t4 = time.perf_counter()
        engine_now = llm.get_weights()
        copied = sum(_buffer(engine_now[n]) != _buffer(params[n]) for n in params)
        rec = dict(step=step, reward=float(rewards.mean()), loss=float(loss),
                   logprob_gap=gap, sample_s=t1 - t0, train_s=t3 - t2, update_s=t4 - t3,
                   copied_tensors=copied)
        history.append(rec)
        log(f"step {step}: reward {rec['reward']:.3f} loss {rec['loss']:+.4f} | sample "
            f"{rec['sample_s'] * 1e3:.0f} ms, train {rec['train_s'] * 1e3:.0f} ms, "
            f"update_weights {rec['update_s'] * 1e3:.2f} ms ({copied} of {len(params)} tensors "
            f"copied) | engine vs trainer logprob gap {gap:.2e}")
    t5 = time.perf_counter()
    greedy_after = [o.outputs[0].token_ids for o in llm.generate(prompts, probe, use_tqdm=False)]
    log(f"sample after training: {1e3 * (time.perf_counter() - t5):.0f} ms")
    changed = any(not np.array_equal(first[n], np.asarray(v))
                  for n, v in llm.get_weights().items())
    return dict(steps=history, weights_changed=changed,
                outputs_changed=greedy_after != greedy_before,
                engine_compiles_in_loop=llm.llm_engine.runner.num_compiles - warm_compiles)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo-random")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--json", action="store_true", help="print the result as JSON at the end")
    a = ap.parse_args(argv)
    res = run(a.model, steps=a.steps, num_prompts=a.prompts, group=a.group,
              max_tokens=a.max_tokens, lr=a.lr)
    print(f"weights changed: {res['weights_changed']}, greedy outputs changed: "
          f"{res['outputs_changed']}")
    if a.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
