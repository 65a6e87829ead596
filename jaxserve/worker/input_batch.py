"""The persistent batch: the worker's rows, kept across steps and changed only by diffs.

A request holds one row from the step it enters the batch until it finishes or is preempted.
Everything that does not change from step to step lives in the row (its known token ids, its
block table per cache group, its sampling parameters and seed, adapter and state slot), so a
step's host work is the diff (``core.batch_diff.BatchDiff``: new rows, pages gained, rows
freed) and one gather of the scheduled rows into the padded ``StepInputs``
(:meth:`InputBatch.prepare_inputs`, the one builder of a step's inputs on the engine path).

Numpy only. The device keeps the last sampled id of every row (``[max_num_seqs]``, written by
each step's own program at its rows' indices), so a token still on the device is named by the
row that sampled it (``prev_ref``), whatever step that was.
"""
from __future__ import annotations

import heapq

import numpy as np

from jaxserve.core.batch_diff import BatchDiff, NewRequestData
from jaxserve.core.request import PLACEHOLDER
from jaxserve.core.sampling_metadata import (COMPACT_BIAS_WIDTH, COMPACT_STOP_WIDTH,
                                             FULL_STOP_WIDTH, dummy_sampling_arrays,
                                             layout_widths)
from jaxserve.core.sampling_params import MAX_LOGIT_BIAS
from jaxserve.core.step_plan import (TRASH_PAGE, StepPlan, pick_bucket, seq_bucket,
                                     verify_arrays)

_SCALARS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "num_logprobs")


class InputBatch:
    """Rows ``[R = max_num_seqs]`` of host arrays; ``row_of`` maps request ids to rows."""

    def __init__(self, *, max_rows: int, num_groups: int, max_pages: int, block_size: int,
                 max_model_len: int, max_num_seqs: int, eos_token_ids=(),
                 num_spec_tokens: int = 0, seed: int | None = None,
                 max_hidden_state_layers: int = 0, embed_dim: int = 0):
        R, G = max_rows, num_groups
        self.max_rows, self.num_groups, self.max_pages = R, G, max_pages
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.num_spec_tokens = num_spec_tokens
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.rng = np.random.default_rng(seed)  # seeds of unseeded rows, drawn once per row
        self.row_of: dict[str, int] = {}
        self.req_ids: list[str | None] = [None] * R
        self._free = list(range(R))  # a heap: the lowest free row is handed out first
        # a row's generation: ids read back for a row that changed hands since are dropped
        self.generation = np.zeros(R, np.int64)
        self.token_ids = np.zeros((R, max_model_len), np.int32)  # prompt + known output ids
        self.num_known = np.zeros(R, np.int32)  # leading entries of token_ids that are real
        self.num_prompt = np.zeros(R, np.int32)
        self.block_table = np.zeros((G, R, max_pages), np.int32)
        self.num_blocks = np.zeros((G, R), np.int32)
        self.state_slot = np.full(R, -1, np.int32)
        self.lora_id = np.zeros(R, np.int32)
        # sampling parameters, as the sampler reads them (greedy rows: temperature 0)
        self.temperature = np.zeros(R, np.float32)
        self.top_p = np.ones(R, np.float32)
        self.top_k = np.zeros(R, np.int32)
        self.min_p = np.zeros(R, np.float32)
        self.presence_penalty = np.zeros(R, np.float32)
        self.frequency_penalty = np.zeros(R, np.float32)
        self.repetition_penalty = np.ones(R, np.float32)
        self.num_logprobs = np.full(R, -1, np.int32)
        self.seeds = np.zeros((R, 2), np.uint32)
        self.penalties = np.zeros(R, bool)
        self.min_tokens = np.zeros(R, np.int32)
        self.stop_ids = np.full((R, FULL_STOP_WIDTH), -1, np.int32)  # masked under min_tokens
        self.num_stop = np.zeros(R, np.int32)
        self.bias_ids = np.full((R, MAX_LOGIT_BIAS), -1, np.int32)
        self.bias_values = np.zeros((R, MAX_LOGIT_BIAS), np.float32)
        self.num_bias = np.zeros(R, np.int32)
        # return_hidden_states: each row's layers, -1 padded (K = 0: the engine captures none)
        self.hidden_layers = np.full((R, max_hidden_state_layers), -1, np.int32)
        # --enable-prompt-embeds (embed_dim > 0): rows whose prompt is embeddings -> [n, H]
        self.embed_dim = embed_dim
        self.prompt_embeds: dict[int, np.ndarray] = {}
        self._padding: dict[tuple[int, bool], dict] = {}  # read-only sampler padding arrays
        self._added: list[int] = []  # rows the last diff added (their device id is not theirs)

    @classmethod
    def for_runner(cls, runner, eos_token_ids=(), seed: int | None = None) -> InputBatch:
        return cls(max_rows=runner.max_num_seqs, num_groups=runner.num_cache_groups,
                   max_pages=runner.max_pages_per_seq, block_size=runner.block_size,
                   max_model_len=runner.max_model_len, max_num_seqs=runner.max_num_seqs,
                   eos_token_ids=eos_token_ids, num_spec_tokens=runner.num_spec_tokens,
                   seed=seed,
                   max_hidden_state_layers=getattr(runner, "max_hidden_state_layers", 0),
                   embed_dim=(runner.model_config.hidden_size
                              if getattr(runner, "enable_prompt_embeds", False) else 0))

    @property
    def num_rows(self) -> int:
        return len(self.row_of)

    # ---- the diff ----------------------------------------------------------------------
    def apply(self, diff: BatchDiff) -> None:
        """Free the removed rows, add the new ones, write the pages rows gained. A diff that
        names an unknown request, or adds one already in the batch, is an engine bug: it
        raises rather than run a wrong row."""
        for rid in diff.removed:
            row = self.row_of.pop(rid, None)
            if row is not None:
                self._clear(row)
        self._added = [self._add(new) for new in diff.new_reqs]
        for u in diff.page_updates:
            row = self._row(u.req_id)
            n = u.start + len(u.block_ids)
            if n > self.max_pages:
                raise ValueError(f"request {u.req_id!r} needs {n} pages > max {self.max_pages}")
            bt = self.block_table[u.group, row]
            if u.start == 0:
                bt[:] = TRASH_PAGE
            elif u.start != self.num_blocks[u.group, row]:
                raise ValueError(f"pages of request {u.req_id!r} from entry {u.start}, but the "
                                 f"batch has {self.num_blocks[u.group, row]}")
            bt[u.start:n] = u.block_ids
            self.num_blocks[u.group, row] = n

    def _row(self, rid: str) -> int:
        row = self.row_of.get(rid)
        if row is None:
            raise ValueError(f"the batch diff names request {rid!r}, which is not in the batch")
        return row

    def _add(self, new: NewRequestData) -> int:
        if new.req_id in self.row_of:
            raise ValueError(f"request {new.req_id!r} is already in the batch")
        if not self._free:
            raise ValueError(f"the batch is full ({self.max_rows} rows)")
        row = heapq.heappop(self._free)
        self.row_of[new.req_id] = row
        self.req_ids[row] = new.req_id
        self.generation[row] += 1
        ids = new.token_ids
        n = len(ids)
        if n > self.max_model_len:
            raise ValueError(f"request {new.req_id!r} has {n} tokens > {self.max_model_len}")
        known = ids.index(PLACEHOLDER) if PLACEHOLDER in ids else n
        self.token_ids[row, :known] = ids[:known]
        self.num_known[row] = known
        self.num_prompt[row] = new.num_prompt_tokens
        if len(new.block_ids) != self.num_groups:
            raise ValueError(f"request {new.req_id!r} has {len(new.block_ids)} page lists, the "
                             f"batch {self.num_groups} cache groups")
        for g, pages in enumerate(new.block_ids):
            if len(pages) > self.max_pages:
                raise ValueError(f"request {new.req_id!r} needs {len(pages)} pages > max "
                                 f"{self.max_pages}")
            self.block_table[g, row, :len(pages)] = pages
            self.num_blocks[g, row] = len(pages)
        self.state_slot[row] = new.state_slot
        if new.prompt_embeds is not None:
            if not self.embed_dim:
                raise ValueError(f"request {new.req_id!r} has prompt embeddings; the engine "
                                 "takes none (enable_prompt_embeds)")
            self.prompt_embeds[row] = new.prompt_embeds
        self.lora_id[row] = new.lora_int_id
        self._set_sampling(row, new.sampling_params)
        return row

    def _set_sampling(self, row: int, p) -> None:
        g = p.is_greedy  # greedy rows: temperature 0 (the device's rule), the rest inert
        self.temperature[row] = 0.0 if g else p.temperature
        self.top_p[row] = 1.0 if g else p.top_p
        self.top_k[row] = 0 if g else max(p.top_k, 0)
        self.min_p[row] = 0.0 if g else p.min_p
        self.presence_penalty[row] = p.presence_penalty
        self.frequency_penalty[row] = p.frequency_penalty
        self.repetition_penalty[row] = p.repetition_penalty
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.penalties[row] = p.uses_penalties
        if p.seed is not None:
            self.seeds[row] = (p.seed & 0xFFFFFFFF, p.seed >> 32)
        else:
            self.seeds[row] = self.rng.integers(0, 2**32, size=2, dtype=np.uint32)
        self.min_tokens[row] = p.min_tokens
        stops = (list(dict.fromkeys(list(p.stop_token_ids or ()) + self.eos_token_ids))
                 if p.min_tokens else [])
        if len(stops) > FULL_STOP_WIDTH:
            raise ValueError(f"{len(stops)} stop ids, more than {FULL_STOP_WIDTH}")
        self.stop_ids[row, :len(stops)] = stops
        self.num_stop[row] = len(stops)
        bias = p.logit_bias or {}
        self.bias_ids[row, :len(bias)] = list(bias.keys())
        self.bias_values[row, :len(bias)] = list(bias.values())
        self.num_bias[row] = len(bias)
        layers = getattr(p, "return_hidden_states", None) or ()
        if len(layers) > self.hidden_layers.shape[1]:
            raise ValueError(f"return_hidden_states names {len(layers)} layers, more than "
                             f"max_hidden_state_layers={self.hidden_layers.shape[1]}")
        self.hidden_layers[row] = -1
        self.hidden_layers[row, :len(layers)] = layers

    def _clear(self, row: int) -> None:
        """A freed row is all padding again (a from-scratch batch equals a reused one)."""
        self.req_ids[row] = None
        heapq.heappush(self._free, row)
        self.num_known[row] = self.num_prompt[row] = 0
        self.block_table[:, row] = TRASH_PAGE
        self.num_blocks[:, row] = 0
        self.state_slot[row] = -1
        self.lora_id[row] = 0
        self.stop_ids[row] = -1
        self.bias_ids[row] = -1
        self.bias_values[row] = 0.0
        self.num_stop[row] = self.num_bias[row] = self.min_tokens[row] = 0
        self.hidden_layers[row] = -1
        self.prompt_embeds.pop(row, None)

    def snapshot(self) -> dict[str, dict]:
        """What each request's row holds, by request id (row numbers and unseeded rows'
        seeds left out): two batches that hold the same requests compare equal."""
        out = {}
        for rid, row in self.row_of.items():
            d = {name: getattr(self, name)[row].item() for name in _SCALARS + (
                "num_prompt", "state_slot", "lora_id", "min_tokens", "num_stop", "num_bias",
                "penalties")}
            d["token_ids"] = self.token_ids[row, :self.num_known[row]].tolist()
            d["pages"] = [self.block_table[g, row, :self.num_blocks[g, row]].tolist()
                          for g in range(self.num_groups)]
            d["stop_ids"] = self.stop_ids[row, :self.num_stop[row]].tolist()
            d["bias"] = (self.bias_ids[row, :self.num_bias[row]].tolist(),
                         self.bias_values[row, :self.num_bias[row]].tolist())
            out[rid] = d
        return out

    # ---- ids read back -------------------------------------------------------------------
    def record(self, rows: np.ndarray, generations: np.ndarray, positions: np.ndarray,
               token_ids: np.ndarray) -> None:
        """Sampled ids that reached the host: ``token_ids[i]`` is row ``rows[i]``'s id at
        ``positions[i]``; rows that changed hands since (another generation) are skipped."""
        keep = ((rows >= 0) & (token_ids >= 0) & (positions < self.max_model_len))
        keep[keep] &= self.generation[rows[keep]] == generations[keep]
        if keep.any():
            r, p = rows[keep], positions[keep]
            self.token_ids[r, p] = token_ids[keep]
            np.maximum.at(self.num_known, r, p + 1)

    # ---- the step ------------------------------------------------------------------------
    def prepare_inputs(self, diff: BatchDiff, *, ladder, token_bitmask: np.ndarray | None = None,
                       lora_slots: dict[int, int] | None = None,
                       bucket: int | None = None) -> StepPlan:
        """The step's padded inputs, in the smallest bucket of ``ladder`` that holds them
        (``bucket``: in that token bucket; a diff without rows then gives a padding step).

        ``token_bitmask[n_rows, W]``: the rows' allowed tokens (None: all); ``lora_slots``:
        adapter id -> device slot of the adapters this step runs."""
        n_rows = diff.num_rows
        if n_rows == 0 and bucket is None:
            raise ValueError("a step needs at least one scheduled sequence")
        if n_rows > self.max_num_seqs:
            raise ValueError(f"{n_rows} sequences exceed max_num_seqs={self.max_num_seqs}")
        try:
            rows = np.array(list(map(self.row_of.__getitem__, diff.req_ids)), np.int32)
        except KeyError as e:
            raise ValueError(f"the step names request {e.args[0]!r}, which is not in the "
                             "batch") from None
        q_lens = np.array(diff.num_tokens, np.int32)
        if len(q_lens) != n_rows or len(diff.token_ids) != int(q_lens.sum()):
            raise ValueError("the step's token counts do not match its rows and ids")
        if np.any(q_lens < 1):
            raise ValueError("every scheduled sequence needs at least one new token")
        starts = np.asarray(diff.start_pos, np.int32)
        n_tok = int(q_lens.sum())
        if bucket is not None:
            t_bucket, s_bucket = bucket, seq_bucket(bucket, self.max_num_seqs)
            if n_tok > t_bucket or n_rows > s_bucket:
                raise ValueError(f"{n_rows} rows of {n_tok} tokens exceed bucket {bucket}")
        else:
            t_bucket = pick_bucket(ladder, max(n_tok, n_rows))
            s_bucket = seq_bucket(t_bucket, self.max_num_seqs)
            if n_rows > s_bucket:  # only when the ladder's smallest bucket is tiny
                t_bucket = pick_bucket(ladder, n_rows)
                s_bucket = seq_bucket(t_bucket, self.max_num_seqs)

        query_start = np.zeros(s_bucket + 1, np.int32)
        np.cumsum(q_lens, out=query_start[1:n_rows + 1])
        query_start[n_rows + 1:] = n_tok
        row_of_tok = np.repeat(np.arange(n_rows, dtype=np.int32), q_lens)
        pos = starts[row_of_tok] + (np.arange(n_tok, dtype=np.int32) - query_start[row_of_tok])
        if n_tok and int(pos.max()) >= self.max_model_len:
            raise ValueError(f"a position reaches max_model_len={self.max_model_len}")
        ids = np.array(diff.token_ids, np.int32)

        # known ids join the rows' token buffers (prefill chunks, synchronous decodes, drafts
        # stay out: they are not the request's yet); pending ids point at their row
        num_draft = np.asarray(diff.num_draft, np.int32) if diff.num_draft else \
            np.zeros(n_rows, np.int32)
        tok_rows = rows[row_of_tok]
        pending = ids == PLACEHOLDER
        if num_draft.any():
            draft = (np.arange(n_tok) - query_start[row_of_tok]
                     >= (q_lens - num_draft)[row_of_tok])
            known = ~pending & ~draft
        else:
            known = ~pending
        if known.all():
            self.token_ids[tok_rows, pos] = ids
        else:
            self.token_ids[tok_rows[known], pos[known]] = ids[known]
        ends = starts + q_lens - num_draft
        if pending.any() and self._added and np.isin(tok_rows[pending], self._added).any():
            raise ValueError("a pending id in a row that entered the batch this step: the "
                             "device holds another request's id there")
        if pending.any():  # a row's one pending id is its last: known up to it
            ends = ends - np.bincount(row_of_tok[pending], minlength=n_rows).astype(np.int32)
        self.num_known[rows] = np.maximum(self.num_known[rows], ends)

        token_ids = np.zeros(t_bucket, np.int32)
        token_ids[:n_tok] = np.where(pending, 0, ids)
        prev_ref = np.full(t_bucket, -1, np.int32)
        prev_ref[:n_tok][pending] = tok_rows[pending]
        positions = np.zeros(t_bucket, np.int32)
        positions[:n_tok] = pos

        # pages: each scheduled row's block tables, gathered
        needed = (starts + q_lens - 1) // self.block_size + 1
        have = self.num_blocks[:, rows]
        if np.any(needed > have):
            g, bad = map(int, np.argwhere(needed > have)[0])
            raise ValueError(f"sequence {bad} has {have[g, bad]} pages, needs {needed[bad]}")
        block_tables = np.zeros((self.num_groups, s_bucket, self.max_pages), np.int32)
        block_tables[:, :n_rows] = self.block_table[:, rows]
        slot_mapping = np.full((self.num_groups, t_bucket), TRASH_PAGE * self.block_size,
                               np.int32)
        slot_mapping[:, :n_tok] = (block_tables[:, row_of_tok, pos // self.block_size]
                                   * self.block_size + pos % self.block_size)

        seq_lens = np.zeros(s_bucket, np.int32)
        seq_lens[:n_rows] = starts + q_lens
        logits_indices = np.zeros(s_bucket, np.int32)
        logits_indices[:n_rows] = query_start[1:n_rows + 1] - 1
        sample = np.asarray(diff.sample, bool)
        sample_mask = np.zeros(s_bucket, bool)
        sample_mask[:n_rows] = sample
        token_rows = np.full(s_bucket, -1, np.int32)
        token_rows[:n_rows] = np.where(sample, rows, -1)
        state_slots = np.full(s_bucket, -1, np.int32)
        state_slots[:n_rows] = self.state_slot[rows]
        lora = np.full(t_bucket, -1, np.int32)
        if lora_slots:
            ids_of_rows = self.lora_id[rows]
            slot_rows = np.full(n_rows, -1, np.int32)
            for lid, slot in lora_slots.items():
                slot_rows[ids_of_rows == lid] = slot
            lora[:n_tok] = slot_rows[row_of_tok]

        sampling, history_ref = self._sampling(diff, rows, sample, starts + q_lens - num_draft,
                                               pending, query_start, s_bucket)
        if token_bitmask is not None:
            mask = np.full((s_bucket, token_bitmask.shape[1]), -1, np.int32)
            mask[:n_rows] = token_bitmask
            token_bitmask = mask
        hidden_layers = None
        if self.hidden_layers.shape[1]:
            hidden_layers = np.full((s_bucket, self.hidden_layers.shape[1]), -1, np.int32)
            hidden_layers[:n_rows] = self.hidden_layers[rows]
        embed_mask = embeds = None
        if self.embed_dim:
            embed_mask = np.zeros(t_bucket, np.bool_)
            if self.prompt_embeds:
                embed_mask, embeds = self._embeds(rows, row_of_tok, pos, t_bucket)
        prompt_next_ids = None
        if diff.prompt_spans:
            prompt_next_ids = np.zeros(t_bucket, np.int32)
            for i, (lo, hi) in diff.prompt_spans.items():
                t0 = int(query_start[i])
                prompt_next_ids[t0:t0 + hi - lo] = self.token_ids[rows[i], lo + 1:hi + 1]
        spec = (None, None, None)
        next_token_ids = None
        if self.num_spec_tokens:
            spec = verify_arrays(logits_indices, token_ids, prev_ref, num_draft,
                                 self.num_spec_tokens)
            # the known token after a row that samples nothing (a prefill chunk's next
            # prompt token) for the MTP head; -1 for a sampling row
            nxt = seq_lens[:n_rows]
            inside = ~sample & (nxt < self.num_known[rows])
            next_token_ids = np.full(s_bucket, -1, np.int32)
            next_token_ids[:n_rows][inside] = self.token_ids[rows[inside], nxt[inside]]
        return StepPlan(
            token_ids=token_ids, positions=positions, slot_mapping=slot_mapping,
            query_start=query_start, seq_lens=seq_lens, block_tables=block_tables,
            logits_indices=logits_indices, prev_ref=prev_ref, state_slots=state_slots,
            lora_slots=lora, token_rows=token_rows, sampling=sampling, history_ref=history_ref,
            sample_mask=sample_mask, token_bitmask=token_bitmask,
            spec_logits_indices=spec[0], draft_token_ids=spec[1], num_draft=spec[2],
            prompt_next_ids=prompt_next_ids, next_token_ids=next_token_ids,
            num_seqs=n_rows, num_tokens=n_tok, hidden_layers=hidden_layers,
            embed_mask=embed_mask, prompt_embeds=embeds)

    def _embeds(self, rows, row_of_tok, pos, t_bucket: int):
        """(embed_mask [T], prompt_embeds [T, H] or None): the step's tokens at positions of
        a prompt given as embeddings read that prompt's rows."""
        mask = np.zeros(t_bucket, np.bool_)
        embeds = None
        for i, row in enumerate(rows.tolist()):
            e = self.prompt_embeds.get(row)
            if e is None:
                continue
            toks = np.flatnonzero((row_of_tok == i) & (pos < len(e)))
            if not toks.size:
                continue
            if embeds is None:
                embeds = np.zeros((t_bucket, self.embed_dim), np.float32)
            mask[toks] = True
            embeds[toks] = e[pos[toks]]
        return mask, embeds

    def _sampling(self, diff: BatchDiff, rows, sample, hist_len, pending, query_start,
                  s_bucket: int):
        """The sampler's arrays (``core.sampling_metadata`` layouts) and ``history_ref``:
        the rows' parameters gathered; the wide layout when a row needs it."""
        n = len(rows)
        steps = np.asarray(diff.num_output, np.int32)
        srows = rows[sample]
        mask_stop = sample & (steps < self.min_tokens[rows]) & (self.num_stop[rows] > 0)
        pen = sample & self.penalties[rows]
        full = bool(pen.any() or (self.num_bias[srows] > COMPACT_BIAS_WIDTH).any()
                    or (self.num_stop[rows][mask_stop] > COMPACT_STOP_WIDTH).any())
        padding = self._padding.get((s_bucket, full))
        if padding is None:
            padding = self._padding[(s_bucket, full)] = dummy_sampling_arrays(
                s_bucket, full=full, history_len=self.max_model_len)
            for x in padding.values():
                x.flags.writeable = False  # shared by every step that leaves it as it is
        a = dict(padding)
        history_ref = np.full((s_bucket, 2), -1, np.int32)
        if not srows.size:
            return a, history_ref

        def own(name):  # a field this step writes: its own copy of the padding
            x = a[name] = padding[name].copy()
            return x

        L, B, E = layout_widths(full, self.max_model_len)
        idx = np.flatnonzero(sample)
        for name in _SCALARS:
            own(name)[idx] = getattr(self, name)[srows]
        own("steps")[idx] = steps[sample]
        own("seeds")[idx] = self.seeds[srows]
        own("mask_stop")[:n] = mask_stop
        ms = np.flatnonzero(mask_stop)
        if ms.size:
            own("stop_ids")[ms] = self.stop_ids[rows[ms], :E]
        biased = idx[self.num_bias[srows] > 0]
        if biased.size:
            own("bias_ids")[biased] = self.bias_ids[rows[biased], :B]
            own("bias_values")[biased] = self.bias_values[rows[biased], :B]
        pi = np.flatnonzero(pen)
        if pi.size:
            own("history")
            own("prompt_lens")
            lens = hist_len[pi]
            if int(lens.max()) > L:
                raise ValueError(f"{int(lens.max())} tokens exceed history_len={L}")
            hist = self.token_ids[rows[pi], :L]
            known = np.minimum(lens, self.num_known[rows[pi]])
            a["history"][pi] = np.where(np.arange(L)[None, :] < known[:, None], hist, -1)
            a["prompt_lens"][pi] = self.num_prompt[rows[pi]]
            # the one pending id of a penalty row (its last new token) is read on the device
            last = query_start[pi + 1] - 1
            has = pending[last]
            history_ref[pi[has]] = np.stack([rows[pi[has]], lens[has] - 1], axis=1)
        return a, history_ref
