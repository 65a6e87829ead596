"""The Triton-language kernels of :mod:`pallas_kernels.triton_attention` (imports ``triton``).

A module of its own because a ``triton.jit`` function finds the functions it calls among its
module's globals, and ``triton_attention`` must import without Triton installed.
"""
import triton
import triton.language as tl


@triton.jit
def decode_row(b, qs_ptr, sl_ptr, nseq_ptr, BQ: tl.constexpr):
    q0 = tl.load(qs_ptr + b)
    q_len = tl.load(qs_ptr + b + 1) - q0
    sl = tl.load(sl_ptr + b)
    ok = (b < tl.load(nseq_ptr)) & (sl > 0) & (q_len > 0) & (q_len <= BQ)
    return b, q0, tl.where(ok, q_len, 0), sl - q_len


@triton.jit
def prefill_row(b, qs_ptr, sl_ptr, nseq_ptr, BQ: tl.constexpr, BQ_DEC: tl.constexpr,
                S_LEN: tl.constexpr, SP: tl.constexpr):
    # The long rows' query blocks are numbered consecutively; a program finds its row by a
    # prefix sum over every row's block count (S ints in registers).
    i = tl.arange(0, SP)
    ic = tl.minimum(i, S_LEN - 1)
    lo = tl.load(qs_ptr + ic)
    q_len = tl.load(qs_ptr + ic + 1) - lo
    sl = tl.load(sl_ptr + ic)
    ok = (i < S_LEN) & (i < tl.load(nseq_ptr)) & (sl > 0) & (q_len > BQ_DEC)
    nblk = tl.where(ok, (q_len + BQ - 1) // BQ, 0)
    end = tl.cumsum(nblk, 0)
    seq = tl.minimum(tl.sum((end <= b).to(tl.int32), 0), S_LEN - 1)
    first = tl.sum(tl.where(i == seq, end - nblk, 0), 0)
    active = b < tl.sum(nblk, 0)
    q0_seq = tl.load(qs_ptr + seq)
    q_len_s = tl.load(qs_ptr + seq + 1) - q0_seq
    j = (b - first) * BQ
    qn = tl.where(active, tl.minimum(tl.maximum(q_len_s - j, 0), BQ), 0)
    return seq, q0_seq + j, qn, tl.load(sl_ptr + seq) - q_len_s + j


@triton.jit
def limits(lim_ptr, sl_ptr, seq, q0, qn, pos0, BLOCK_M: tl.constexpr, GP: tl.constexpr,
           LIMITED: tl.constexpr):
    """Each row's last visible position (its token's, or where later its ``kv_limit`` inside
    the row's context) and one past the block's furthest (the Pallas kernel's ``_limits``)."""
    tok = tl.arange(0, BLOCK_M) // GP
    if LIMITED:
        lim = tl.load(lim_ptr + q0 + tok, mask=tok < qn, other=-1)
        hi = tl.maximum(pos0 + tok, tl.minimum(lim, tl.load(sl_ptr + seq) - 1))
        end = tl.maximum(pos0 + qn, tl.max(tl.where(tok < qn, hi, -1), 0) + 1)
    else:
        hi = pos0 + tok
        end = pos0 + qn
    return hi, end


@triton.jit
def kv_range(pos0, qn, hi_tok, sp, nseq_ptr, PAGE_SIZE: tl.constexpr, BLOCK_KV: tl.constexpr,
             WINDOW: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_TARGET: tl.constexpr,
             HKV: tl.constexpr, MIN_ITERS: tl.constexpr):
    """KV steps [it_lo, it_hi) of split ``sp``, the page-aligned first KV token, the split
    count (the same rule as the Pallas kernel's ``_kv_range``); ``hi_tok``: one past the
    block's last visible KV position."""
    if WINDOW > 0:
        lo_tok = tl.maximum(pos0 - WINDOW + 1, 0)
    else:
        lo_tok = pos0 * 0
    kv_lo = (lo_tok // PAGE_SIZE) * PAGE_SIZE
    nkv = tl.where(qn > 0, (hi_tok - kv_lo + BLOCK_KV - 1) // BLOCK_KV, 0)
    if NUM_SPLITS > 1 and SPLIT_TARGET > 0:
        work = tl.maximum(tl.load(nseq_ptr) * HKV, 1)
        splits = tl.minimum(tl.maximum((SPLIT_TARGET + work - 1) // work, 1), NUM_SPLITS)
    else:
        splits = NUM_SPLITS
    bps = tl.maximum((nkv + splits - 1) // splits, MIN_ITERS)
    it_lo = sp * bps
    it_hi = tl.minimum(it_lo + bps, nkv)
    nsplit = (nkv + bps - 1) // bps
    return it_lo, it_hi, kv_lo, nsplit


@triton.jit
def row_index(q0, qn, h, BLOCK_M: tl.constexpr, GP: tl.constexpr, GROUP: tl.constexpr,
              HQ: tl.constexpr):
    """Flat ``[T * Hq]`` row of every (token, query head) of a block, whether it is real,
    and its token offset in the block."""
    r = tl.arange(0, BLOCK_M)
    tok = r // GP
    head = r % GP
    ok = (tok < qn) & (head < GROUP)
    return tl.where(ok, (q0 + tok) * HQ + h * GROUP + head, 0), ok, tok


@triton.jit
def kv_step(it, acc, m_i, l_i, q, q_pos, q_hi, row_ok, seq, h, kv_lo, bt_ptr, k_ptr, v_ptr,
            sm_scale, soft_cap, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr,
            PAGE_SIZE: tl.constexpr, BLOCK_KV: tl.constexpr, MAX_PAGES: tl.constexpr,
            NUM_PAGES: tl.constexpr, WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr,
            DOT_PREC: tl.constexpr):
    kv0 = kv_lo + it * BLOCK_KV
    kv_tok = kv0 + tl.arange(0, BLOCK_KV)
    # Columns past the table's end only feed masked positions: clamp, don't pad.
    col = tl.minimum(kv_tok // PAGE_SIZE, MAX_PAGES - 1)
    page = tl.load(bt_ptr + seq * MAX_PAGES + col)
    page = tl.minimum(tl.maximum(page, 0), NUM_PAGES - 1)  # a bad table must not fault
    slot = (h * (NUM_PAGES * PAGE_SIZE) + page * PAGE_SIZE + kv_tok % PAGE_SIZE).to(tl.int64)
    dcol = tl.arange(0, HEAD_DIM)
    # float8 pages (--kv-cache-dtype fp8) are upcast to q's dtype in registers; their K scale
    # is in ``sm_scale`` (the caller's ``qk_scale``), their V scale applied to the output
    k_t = tl.load(k_ptr + slot[None, :] * HEAD_DIM + dcol[:, None]).to(q.dtype)  # [D, BLOCK_KV]
    v = tl.load(v_ptr + slot[:, None] * HEAD_DIM + dcol[None, :]).to(q.dtype)  # [BLOCK_KV, D]
    s = tl.dot(q, k_t, input_precision=DOT_PREC) * sm_scale
    if SOFT_CAP:
        # soft_cap * tanh(s / soft_cap), through exp (tanh is not in every Triton).
        s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0))
    s = s * 1.4426950408889634  # base-2 units from here on
    if MASKED:
        kv_pos = kv_tok[None, :]
        mask = row_ok[:, None] & (kv_pos <= q_hi[:, None])
        if WINDOW > 0:
            mask = mask & (kv_pos > q_pos[:, None] - WINDOW)
        s = tl.where(mask, s, -2.3819763e38)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    if MASKED:
        p = tl.where(mask, p, 0.0)
    l_new = alpha * l_i + tl.sum(p, 1)
    pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc * alpha[:, None] + pv, m_new, l_new


@triton.jit
def kv_scales(sc_ptr, h, SCALED: tl.constexpr):
    """(K scale, V scale) of KV head ``h`` from the flat ``[Hkv * 2]`` scales; 1.0 unscaled."""
    if SCALED:
        ks = tl.load(sc_ptr + 2 * h)
        vs = tl.load(sc_ptr + 2 * h + 1)
    else:
        ks = 1.0
        vs = 1.0
    return ks, vs


@triton.jit
def attend(qs_ptr, sl_ptr, nseq_ptr, lim_ptr, bt_ptr, q_ptr, k_ptr, v_ptr, sm_scale, soft_cap,
           DECODE: tl.constexpr, BQ: tl.constexpr, BQ_DEC: tl.constexpr,
           S_LEN: tl.constexpr, SP: tl.constexpr, BLOCK_M: tl.constexpr, GP: tl.constexpr,
           GROUP: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
           HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_KV: tl.constexpr,
           MAX_PAGES: tl.constexpr, NUM_PAGES: tl.constexpr, WINDOW: tl.constexpr,
           SOFT_CAP: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_TARGET: tl.constexpr,
           MIN_ITERS: tl.constexpr, DOT_PREC: tl.constexpr, LIMITED: tl.constexpr):
    """Online softmax of one (query block, KV head, split) over its KV steps."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    if DECODE:
        seq, q0, qn, pos0 = decode_row(b, qs_ptr, sl_ptr, nseq_ptr, BQ)
    else:
        seq, q0, qn, pos0 = prefill_row(b, qs_ptr, sl_ptr, nseq_ptr, BQ, BQ_DEC, S_LEN, SP)
    q_hi, hi_tok = limits(lim_ptr, sl_ptr, seq, q0, qn, pos0, BLOCK_M, GP, LIMITED)
    it_lo, it_hi, kv_lo, _ = kv_range(pos0, qn, hi_tok, sp, nseq_ptr, PAGE_SIZE, BLOCK_KV,
                                      WINDOW, NUM_SPLITS, SPLIT_TARGET, HKV, MIN_ITERS)
    idx, row_ok, tok = row_index(q0, qn, h, BLOCK_M, GP, GROUP, HQ)
    dcol = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + idx.to(tl.int64)[:, None] * HEAD_DIM + dcol[None, :],
                mask=row_ok[:, None], other=0.0)
    q_pos = pos0 + tok
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    m_i = tl.full((BLOCK_M,), -2.3819763e38, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    if WINDOW > 0:
        mid = it_lo
    else:
        # KV steps wholly at or before the block's first query position need no mask.
        mid = tl.minimum(tl.maximum((pos0 + 1 - kv_lo) // BLOCK_KV, it_lo), it_hi)
    for it in range(it_lo, mid):
        acc, m_i, l_i = kv_step(it, acc, m_i, l_i, q, q_pos, q_hi, row_ok, seq, h, kv_lo, bt_ptr,
                                k_ptr, v_ptr, sm_scale, soft_cap, False, HEAD_DIM,
                                PAGE_SIZE, BLOCK_KV, MAX_PAGES, NUM_PAGES, WINDOW, SOFT_CAP,
                                DOT_PREC)
    for it in range(mid, it_hi):
        acc, m_i, l_i = kv_step(it, acc, m_i, l_i, q, q_pos, q_hi, row_ok, seq, h, kv_lo, bt_ptr,
                                k_ptr, v_ptr, sm_scale, soft_cap, True, HEAD_DIM,
                                PAGE_SIZE, BLOCK_KV, MAX_PAGES, NUM_PAGES, WINDOW, SOFT_CAP,
                                DOT_PREC)
    # Whether this program ran, per row (a vector: the interpreter cannot mask with a scalar).
    ran = (tl.arange(0, BLOCK_M) * 0 + it_hi) > it_lo
    return acc, m_i, l_i, idx, row_ok, ran


@triton.jit
def attn_direct_kernel(qs_ptr, sl_ptr, nseq_ptr, lim_ptr, bt_ptr, q_ptr, k_ptr, v_ptr, sc_ptr,
                       out_in_ptr, out_ptr, sm_scale: tl.constexpr, soft_cap: tl.constexpr,
                       DECODE: tl.constexpr, BQ: tl.constexpr, BQ_DEC: tl.constexpr,
                       S_LEN: tl.constexpr, SP: tl.constexpr, BLOCK_M: tl.constexpr,
                       GP: tl.constexpr, GROUP: tl.constexpr, HQ: tl.constexpr,
                       HKV: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                       BLOCK_KV: tl.constexpr, MAX_PAGES: tl.constexpr,
                       NUM_PAGES: tl.constexpr, WINDOW: tl.constexpr,
                       SOFT_CAP: tl.constexpr, NUM_SPLITS: tl.constexpr,
                       SPLIT_TARGET: tl.constexpr, MIN_ITERS: tl.constexpr,
                       DOT_PREC: tl.constexpr, SCALED: tl.constexpr,
                       LIMITED: tl.constexpr):
    """Unsplit call: the normalised rows go straight into the output (aliased in place)."""
    ks, vs = kv_scales(sc_ptr, tl.program_id(1), SCALED)
    acc, m_i, l_i, idx, row_ok, ran = attend(
        qs_ptr, sl_ptr, nseq_ptr, lim_ptr, bt_ptr, q_ptr, k_ptr, v_ptr, sm_scale * ks, soft_cap,
        DECODE, BQ, BQ_DEC, S_LEN, SP, BLOCK_M, GP, GROUP, HQ, HKV, HEAD_DIM, PAGE_SIZE,
        BLOCK_KV, MAX_PAGES, NUM_PAGES, WINDOW, SOFT_CAP, NUM_SPLITS, SPLIT_TARGET, MIN_ITERS,
        DOT_PREC, LIMITED)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None] * vs
    dcol = tl.arange(0, HEAD_DIM)
    tl.store(out_ptr + idx.to(tl.int64)[:, None] * HEAD_DIM + dcol[None, :],
             out.to(out_ptr.dtype.element_ty),
             mask=(row_ok & ran)[:, None] & (dcol[None, :] < HEAD_DIM))


@triton.jit
def attn_split_kernel(qs_ptr, sl_ptr, nseq_ptr, lim_ptr, bt_ptr, q_ptr, k_ptr, v_ptr, sc_ptr,
                      o_part_ptr, lse_ptr, sm_scale: tl.constexpr, soft_cap: tl.constexpr,
                      DECODE: tl.constexpr, BQ: tl.constexpr, BQ_DEC: tl.constexpr,
                      S_LEN: tl.constexpr, SP: tl.constexpr, BLOCK_M: tl.constexpr,
                      GP: tl.constexpr, GROUP: tl.constexpr, HQ: tl.constexpr,
                      HKV: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                      BLOCK_KV: tl.constexpr, MAX_PAGES: tl.constexpr,
                      NUM_PAGES: tl.constexpr, WINDOW: tl.constexpr,
                      SOFT_CAP: tl.constexpr, NUM_SPLITS: tl.constexpr,
                      SPLIT_TARGET: tl.constexpr, MIN_ITERS: tl.constexpr,
                      DOT_PREC: tl.constexpr, SCALED: tl.constexpr,
                      LIMITED: tl.constexpr):
    """Split call: each split's normalised rows and base-2 log-sum-exp, ``[ns, nb, Hkv, bm]``."""
    ks, vs = kv_scales(sc_ptr, tl.program_id(1), SCALED)
    acc, m_i, l_i, idx, row_ok, ran = attend(
        qs_ptr, sl_ptr, nseq_ptr, lim_ptr, bt_ptr, q_ptr, k_ptr, v_ptr, sm_scale * ks, soft_cap,
        DECODE, BQ, BQ_DEC, S_LEN, SP, BLOCK_M, GP, GROUP, HQ, HKV, HEAD_DIM, PAGE_SIZE,
        BLOCK_KV, MAX_PAGES, NUM_PAGES, WINDOW, SOFT_CAP, NUM_SPLITS, SPLIT_TARGET, MIN_ITERS,
        DOT_PREC, LIMITED)
    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    out = acc / l_safe[:, None] * vs
    lse = tl.where(has, m_i + tl.log2(l_safe), -2.3819763e38)
    part = ((tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)) * HKV
            + tl.program_id(1)).to(tl.int64) * BLOCK_M
    r = tl.arange(0, BLOCK_M)
    dcol = tl.arange(0, HEAD_DIM)
    tl.store(o_part_ptr + (part + r)[:, None] * HEAD_DIM + dcol[None, :], out,
             mask=ran[:, None] & (dcol[None, :] < HEAD_DIM))
    tl.store(lse_ptr + part + r, lse, mask=ran)


@triton.jit
def combine_kernel(qs_ptr, sl_ptr, nseq_ptr, lim_ptr, o_part_ptr, lse_ptr, out_in_ptr, out_ptr,
                   NUM_BLOCKS: tl.constexpr, DECODE: tl.constexpr, BQ: tl.constexpr,
                   BQ_DEC: tl.constexpr, S_LEN: tl.constexpr, SP: tl.constexpr,
                   BLOCK_M: tl.constexpr, GP: tl.constexpr, GROUP: tl.constexpr,
                   HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr,
                   PAGE_SIZE: tl.constexpr, BLOCK_KV: tl.constexpr, WINDOW: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, SPLIT_TARGET: tl.constexpr,
                   MIN_ITERS: tl.constexpr, LIMITED: tl.constexpr):
    """Merge the splits of one (query block, KV head); reads only the splits that ran."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    if DECODE:
        seq, q0, qn, pos0 = decode_row(b, qs_ptr, sl_ptr, nseq_ptr, BQ)
    else:
        seq, q0, qn, pos0 = prefill_row(b, qs_ptr, sl_ptr, nseq_ptr, BQ, BQ_DEC, S_LEN, SP)
    _, hi_tok = limits(lim_ptr, sl_ptr, seq, q0, qn, pos0, BLOCK_M, GP, LIMITED)
    _, _, _, nsplit = kv_range(pos0, qn, hi_tok, 0, nseq_ptr, PAGE_SIZE, BLOCK_KV, WINDOW,
                               NUM_SPLITS, SPLIT_TARGET, HKV, MIN_ITERS)
    r = tl.arange(0, BLOCK_M)
    dcol = tl.arange(0, HEAD_DIM)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    m_i = tl.full((BLOCK_M,), -2.3819763e38, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    for i in range(0, nsplit):
        part = ((i * NUM_BLOCKS + b) * HKV + h).to(tl.int64) * BLOCK_M
        lse = tl.load(lse_ptr + part + r)
        o = tl.load(o_part_ptr + (part + r)[:, None] * HEAD_DIM + dcol[None, :])
        m_new = tl.maximum(m_i, lse)
        alpha = tl.exp2(m_i - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha[:, None] + o * w[:, None]
        l_i = l_i * alpha + w
        m_i = m_new
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    idx, row_ok, _ = row_index(q0, qn, h, BLOCK_M, GP, GROUP, HQ)
    tl.store(out_ptr + idx.to(tl.int64)[:, None] * HEAD_DIM + dcol[None, :],
             out.to(out_ptr.dtype.element_ty),
             mask=(row_ok & ((r * 0 + nsplit) > 0))[:, None] & (dcol[None, :] < HEAD_DIM))
