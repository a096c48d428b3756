"""The fast built-in rollout engine: the training policy itself, decoded step by step from CUDA graphs.

Same contract as ``BuiltinRollout`` (same ``Rollout``, same masks and log-probs); what changes is how a step runs:

    for each wave of prompts (all of them, or ``wave_rows`` rows' worth of whole groups):
    prompts [B, P] --prefill once (eager, batched)--> slot KV cache rows 0..B-1 --copy to G rows each--> N = B*G rows
    (the prefill runs through the same fused step as the decode, all B*P tokens at once, where the step is fused)
    decode step t (one graph replay, nothing on the host):
        write K/V at position P+t-1 of rows 0..b-1  ->  attention over cache columns 0..L-1 (L = t's length bucket)
        -> logits -> Gumbel-max sample on the GPU -> history[row, t] -> finished |= token in EOS
    every ``check_every`` steps (the only host syncs): stop if all rows finished, else move the live rows to the
    front (rows, cache, mask) and continue in the smallest batch bucket that holds them.

- Sampling noise: each output row's Exp(1) draws are a hash of (rollout key, row, step, token)
  (``qerl.rollout.row_noise``; the step is the row's own count of sampled tokens, ``DecodeState.col``), so a row
  samples the same tokens whatever its wave, slot or compaction order.
- Multi-turn episodes (``play_episodes``, ``qerl.rollout.episode_wave``): a row that ends its turn idles like a
  finished row (the columns it writes meanwhile stay masked, its position stays); at the next check its tool results
  come back from the caller and go on in its own cache row: a short block is fed through the next decode steps, a
  token per step, a long one is prefilled (one eager prefill of those rows' new tokens, through the fused prefill
  where the model is fused); it decodes on with the rows that never stopped. A prompt is prefilled once; each wave
  plays its episodes to their ends. The cache then holds prompt + ``episode_columns``.

- KV cache: our own ``SlotCache`` sized from the request (one wave's rows x prompt+completion length, rounded up so
  it and the graphs are reused by later requests of the same or smaller size); a large one is freed when the rollout
  ends, for the update (``keep_kv_cache``). A step sees only the first ``b`` rows and the
  first ``L`` columns, so finished rows and unwritten columns cost no bandwidth.
- Graphs: one per (batch bucket ``b``, length bucket ``L``), captured on first use (the step that needs it runs
  eagerly first and doubles as the warm-up), kept across calls. They read the LoRA matrices and RMSNorm weights from
  their storage at replay time, so an optimizer step (in place) and AQN noise (added in place, restored exactly by
  ``noisy_norms``) are live; if any parameter is *replaced* (a new storage), the graphs are dropped and recaptured.
- The decode step itself is ``qerl.rollout.fused_decoder.FusedDecoder`` for Llama/Qwen2-family models (a few
  kernels per layer: stacked GEMMs, fused epilogues, flash-decoding attention over the cache rows). Other models go through
  the transformers forward, whose decode attention is a GQA matmul over the cache views (``qerl_decode``, registered
  with transformers' AttentionInterface: its SDPA path with a mask would repeat K/V for every query head).
- Masks are passed as ready 4-D bool tensors, which transformers' mask builders return as they are.
- On CPU the same step function runs eagerly: that is what the CPU tests check.

Selected in place of ``BuiltinRollout`` by config (``class_path: qerl.rollout.cuda_graph.CUDAGraphRollout``).
"""

from __future__ import annotations

import math
import warnings
from contextlib import contextmanager, nullcontext
from typing import Literal

import torch
from torch.nn.attention import sdpa_kernel

from qerl.model.aqn import noisy_norms
from qerl.model.experts import parameters_outside_experts
from qerl.model.attention import SDPA_KERNELS
from qerl.model.routing import RoutingRecorder
from qerl.kernels.kv_cache_element import KV_CACHE_DTYPES, cache_dtype
from qerl.rollout.adapter_copies import AdapterCopies
from qerl.rollout.base import Rollout, RolloutEngine, cut_at_eos
from qerl.rollout.builtin import left_pad, position_ids
from qerl.rollout.decode_attention import decode_attention, register_decode_attention
from qerl.rollout.decode_state import MAX_EOS, DecodeState
from qerl.rollout.engine_settings import GraphEngineSettings
from qerl.rollout.episode_wave import EpisodeWave, episode_columns
from qerl.rollout.episodes import EpisodeTurns
from qerl.rollout.footprint import wants_bf16_copy
from qerl.rollout.graph_cache import GraphCache, GraphKey
from qerl.rollout.kernel_choice import Kernels
from qerl.rollout.footprint import wave_prompts as wave_prompts_of
from qerl.rollout.kv_cache import SlotCache, head_dim
from qerl.rollout.sampling import sample_rows
from qerl.rollout.sampling_spec import SamplingSpec
from qerl.rollout.wave_costs import WaveCosts

def _base_model(policy):
    return policy.get_base_model() if hasattr(policy, "get_base_model") else policy


class CUDAGraphRollout(RolloutEngine):
    """Samples with the policy being trained, one CUDA graph replay per decode step (see the module docstring).

    Args:
        check_every: decode steps between the host's looks at how many rows are still running (each look is one
            GPU->CPU sync; it decides early stop and batch compaction).
        length_bucket: cache columns are attended in multiples of this many tokens (one graph per multiple).
        min_bucket: the smallest batch bucket (buckets are the request's row count and the powers of two below it).
        adapter_in_model_dtype: run the LoRA matrices in the model's dtype (bf16) during the rollout: peft keeps them
            fp32, which turns every adapter call into fp32 SIMT GEMMs plus casts.
            The bf16 copies live in fixed buffers refreshed from the trained weights at every call, so graphs stay
            valid; the log-probs returned are those of the bf16-adapter distribution actually sampled.
        fused: decode with :class:`qerl.rollout.fused_decoder.FusedDecoder` (a few kernels per layer instead of
            dozens through transformers + peft; stacked q|k|v and gate|up GEMMs; default: on CUDA), and prefill the
            prompts through the same kernels (all their tokens at once; the attention is transformers' SDPA).
            Llama/Qwen2-family models only: others keep the transformers step (with a warning). The log-probs
            returned are those of the distribution sampled (it rounds like transformers except the order of fp32
            sums).
        wide_batch_bf16: decode steps of more than 64 rows multiply a bf16 copy of the NVFP4 weights, made when the
            rollout starts and freed when it ends (one pass at memory speed; 2 bytes per weight meanwhile). Without it
            (False, or no room) the groups of >= 20M weights run the token-block wgmma GEMV on sm_90 and the others
            are dequantized per call: somewhat slower steps, no extra memory (docs/performance.md has the numbers).
            Fused step on CUDA only; bf16 models are unaffected.
        wave_rows: decode at most this many rows at once (whole groups), wave after wave, so that the KV cache holds
            one wave instead of the whole batch (None: every row in one wave). Each row's sampling noise is a function
            of its output row and step, so the samples are the same whatever the wave size.
        keep_kv_cache: keep the KV cache allocated between rollouts (True), or free it when a rollout ends so the
            update can use the memory (False; the next rollout allocates it again).
        turn_check_every: decode steps between the checks of a multi-turn wave (``play_episodes``; None:
            ``check_every``). A row whose turn ends idles until the next check hands its turn over and one more
            interval until its observation is appended (about 1.5 intervals per turn); each check with rows to resume
            runs an eager prefill of their observations.
        max_hole_columns: a multi-turn wave packs its rows' cache columns (``DecodeState.defragment``, one gather)
            at a check where the columns in use exceed the longest row's context by more than this: every step
            attends the holes (columns of idle steps and of other rows' observations) of every row. None: only when
            the cache is full. ``bench/agent_wave_costs.py`` counts both sides of the trade on the CPU.
        turn_bucket_rows: a multi-turn wave's batch buckets are the multiples of this many rows (and the powers of
            two below it): a batch closer to the rows still playing, for a few more captured graphs. None: the powers
            of two, as a single-turn wave's.
        prefill_lead_steps: at a check that resumes rows, the rows still running first take this many decode steps
            (graph replays, queued at once), then the observations' eager prefill is launched: the host launches its
            kernels while the GPU runs those steps, instead of the GPU waiting for the host (more idles the resumed
            rows longer: docs/performance.md has the measurements); at most ``turn_check_every`` - 1 (they count to
            the next check); 0: the prefill first.
        feed_observation_tokens: a resumed row whose observation block (the turn's last token + the observation)
            has at most this many tokens is not prefilled: the block is fed through the next decode steps of the
            running batch, a token per step (``DecodeState.start_feeding``), so a check launches no prefill for it;
            the row samples its next turn from the step that reads the block's last token. A longer block takes
            the eager prefill (each of its tokens would cost the row a step). 0: every block is prefilled.
        check_lag_steps: a multi-turn check reads the rows' state (a copy to the host queued behind the steps so
            far), launches this many more decode steps of the batch, and only then does its host work (hand the
            stopped turns over, lay the slots out, resume rows): the GPU runs those steps meanwhile instead of
            idling through the check. A row that stopped just before the check idles that many more steps; a row
            that stops during them is handed over at the next check. 0: the host work right after the sync;
            ``check_lag_steps`` + ``prefill_lead_steps`` is at most ``turn_check_every`` - 1.

        ``wave_rows``, ``wide_batch_bf16`` and ``keep_kv_cache`` are planned (``GraphEngineSettings``): ``train.py``
        decides those a config leaves unset from the memory plan before the engine is built; an engine built in code
        without them takes ``GraphEngineSettings.unplanned()``.
        kv_cache_dtype: ``auto``: the KV cache in the model's dtype; ``fp8_e4m3``: one byte per element (vLLM's
            option of the same name, scale 1): half the cache memory (twice the rows per wave) and half the bytes
            each decode step's attention reads. K and V are rounded to e4m3, so the sampling policy moves a little
            further from the trained one; the truncated-IS weights of the loss correct for it as they do for the
            NVFP4 kernels and AQN noise (docs/performance.md compares the gap with AQN's). Needs a GPU of compute
            capability >= 8.9 (Ada, Hopper) for the fused step; any device otherwise.
    """

    settings = GraphEngineSettings  # what the memory plan reads of this engine and plans for it

    def __init__(
        self,
        check_every: int = 16,
        length_bucket: int = GraphEngineSettings.length_bucket,
        min_bucket: int = 1,
        adapter_in_model_dtype: bool = True,
        fused: bool | None = None,
        wide_batch_bf16: bool | None = None,
        wave_rows: int | None = None,
        keep_kv_cache: bool | None = None,
        kv_cache_dtype: Literal["auto", "fp8_e4m3"] = "auto",
        turn_check_every: int | None = None,
        max_hole_columns: int | None = 256,
        turn_bucket_rows: int | None = None,
        prefill_lead_steps: int = 4,
        feed_observation_tokens: int = 64,
        check_lag_steps: int = 2,
    ):
        super().__init__()
        unplanned = GraphEngineSettings.unplanned()
        wide_batch_bf16 = unplanned["wide_batch_bf16"] if wide_batch_bf16 is None else wide_batch_bf16
        keep_kv_cache = unplanned["keep_kv_cache"] if keep_kv_cache is None else keep_kv_cache
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"model.rollout.init_args.kv_cache_dtype={kv_cache_dtype!r} is not one of "
                             f"{', '.join(KV_CACHE_DTYPES)}; use auto (the model's dtype) or fp8_e4m3.")
        self.kv_cache_dtype = kv_cache_dtype
        if check_every < 1 or length_bucket < 1 or min_bucket < 1:
            raise ValueError("check_every, length_bucket and min_bucket must be >= 1.")
        if wave_rows is not None and wave_rows < 1:
            raise ValueError(f"wave_rows must be >= 1 (or None: all rows in one wave), got {wave_rows}.")
        turn_check_every = check_every if turn_check_every is None else turn_check_every
        if turn_check_every < 1:
            raise ValueError(f"model.rollout.init_args.turn_check_every={turn_check_every} must be >= 1 (or None: "
                             f"check_every, {check_every}).")
        if max_hole_columns is not None and max_hole_columns < 0:
            raise ValueError(f"model.rollout.init_args.max_hole_columns={max_hole_columns} must be >= 0 (or None: "
                             "pack an episode wave's cache columns only when it is full).")
        if turn_bucket_rows is not None and turn_bucket_rows < 1:
            raise ValueError(f"model.rollout.init_args.turn_bucket_rows={turn_bucket_rows} must be >= 1 (or None: "
                             "batch buckets of powers of two).")
        if prefill_lead_steps < 0:
            raise ValueError(f"model.rollout.init_args.prefill_lead_steps={prefill_lead_steps} must be >= 0 (0: the "
                             "observations' prefill first, then the decode steps).")
        self.turn_check_every, self.max_hole_columns = turn_check_every, max_hole_columns
        self.turn_bucket_rows = turn_bucket_rows
        self.prefill_lead_steps = min(prefill_lead_steps, turn_check_every - 1)  # (they count to the next check)
        if feed_observation_tokens < 0:
            raise ValueError(f"model.rollout.init_args.feed_observation_tokens={feed_observation_tokens} must be >= 0 "
                             "(0: every observation is prefilled).")
        self.feed_observation_tokens = feed_observation_tokens
        if check_lag_steps < 0:
            raise ValueError(f"model.rollout.init_args.check_lag_steps={check_lag_steps} must be >= 0 (0: a check's "
                             "host work right after its sync).")
        self.check_lag_steps = min(check_lag_steps, turn_check_every - 1)  # (they count to the next check)
        self.prefill_lead_steps = min(self.prefill_lead_steps, turn_check_every - 1 - self.check_lag_steps)
        self.costs = WaveCosts()  # what the calls so far read and copied (``qerl.rollout.wave_costs``)
        self.wave_rows, self.keep_kv_cache = wave_rows, keep_kv_cache
        self.check_every, self.length_bucket, self.min_bucket = check_every, length_bucket, min_bucket
        self.adapter_in_model_dtype = adapter_in_model_dtype
        self.fused = fused
        self.wide_batch_bf16 = wide_batch_bf16
        self._adapters = AdapterCopies()
        self._state = None  # buffers of the current size, see _ensure_state
        self._graph_cache = GraphCache()
        self._decoder = None  # ((model id, Kernels), FusedDecoder or None), built on first use
        self._routing: RoutingRecorder | None = None  # the current generate call's, if any
        self._graphs = False  # whether the current call's decode steps replay captured graphs
        self._feeding = False  # whether the current call's steps feed observations (an episode call)

    # ------------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, policy, prompt_ids: list[list[int]], group_size: int, pad_id: int, eos_ids: list[int],
                 spec: SamplingSpec, routing: RoutingRecorder | None = None) -> Rollout:
        """``routing``: told where each forward's tokens sit in the rollout and given their expert choices (a MoE's
        fused step writes them into a buffer, captured steps included)."""
        new = spec.max_new_tokens
        with self._session(policy, prompt_ids, group_size, pad_id, eos_ids, spec, routing, new, new) \
                as (s, ids, mask, waves):
            N, device = ids.shape[0] * group_size, ids.device
            out = {name: torch.zeros(N, new, dtype=getattr(s, name).dtype, device=device) for name in s.OUTPUTS}
            out["tokens_out"].fill_(pad_id)
            steps = 0
            for prompts, first_row in waves:
                wave_steps = self._decode_wave(s, policy, ids[prompts], mask[prompts], group_size, pad_id, eos_ids,
                                               first_row, spec)
                n = (prompts.stop - prompts.start) * group_size
                for name, buffer in out.items():
                    buffer[first_row:first_row + n, :wave_steps] = getattr(s, name)[:n, :wave_steps]
                steps = max(steps, wave_steps)
        self._phase("done", steps - 1)
        eos = torch.tensor(eos_ids if eos_ids else [-1], device=device)
        completion, completion_mask, ended = cut_at_eos(out["tokens_out"][:, :steps], eos, pad_id)
        logprobs = out["logprobs_out"][:, :steps] * completion_mask
        entropy = out["entropy_out"][:, :steps] * completion_mask
        lengths = completion_mask.sum(-1)
        width = int(lengths.max()) if N else 0  # the built-in engine stops when the last row ends
        # (the first token of a row comes from the prefill, the others from decode steps)
        self.costs.decoding(mask.sum(-1).repeat_interleave(group_size).tolist(), (lengths - 1).clamp(min=0).tolist())
        return Rollout(
            prompt_ids=ids.repeat_interleave(group_size, 0),
            prompt_mask=mask.repeat_interleave(group_size, 0),
            completion_ids=completion[:, :width],
            completion_mask=completion_mask[:, :width],
            logprobs=logprobs[:, :width],
            entropy=entropy[:, :width],
            truncated=~ended,
        )

    @torch.no_grad()
    def play_episodes(self, policy, prompt_ids: list[list[int]], group_size: int, pad_id: int, eos_ids: list[int],
                      spec: SamplingSpec, turns: EpisodeTurns) -> None:
        """Multi-turn episodes in the KV cache (``qerl.rollout.episode_wave``): a row's observation is appended to
        its cache row and its next turn decodes on, in the same wave; nothing is prefilled twice."""
        budget = turns.completion_budget
        new = budget + 1  # + a spare column that rows idling at the end of their budget write padding to
        with self._session(policy, prompt_ids, group_size, pad_id, eos_ids, spec, None, new,
                           episode_columns(budget, self.turn_check_every)) as (s, ids, mask, waves):
            self._feeding = True
            try:
                for prompts, first_row in waves:
                    wave = EpisodeWave(self, s, policy, spec, turns, first_row)
                    try:
                        wave.run(ids[prompts], mask[prompts], group_size, pad_id, eos_ids)
                    finally:
                        self.costs.add(wave.costs)
            finally:
                self._feeding = False
        self._phase("done")

    @contextmanager
    def _session(self, policy, prompt_ids: list[list[int]], group_size: int, pad_id: int, eos_ids: list[int],
                 spec: SamplingSpec, routing: RoutingRecorder | None, new: int, columns: int):
        """What a call decodes under: the state sized for a wave of ``new`` output columns and prompt + ``columns``
        cache columns, the rollout's noise key, one AQN draw and one adapter copy (every wave samples the same
        policy). Yields (state, prompt ids [B, P], their mask, [(prompt slice, first output row) per wave])."""
        base = _base_model(policy)
        device = next(policy.parameters()).device
        decoder = self._fused_decoder(base, device)  # before the state: it may move frozen weights (same memory)
        # a MoE's transformers step picks its experts on the host (a loop over the routed ones): it runs eagerly
        self._graphs = self._captures(device) and (decoder is not None or not getattr(base.config, "num_experts", 0))
        self._routing = routing
        generator = self._sampling_generator(spec, device)  # (the graphs never read it: one key per rollout)
        if len(eos_ids) > MAX_EOS:
            raise ValueError(f"At most {MAX_EOS} EOS ids, got {len(eos_ids)}.")
        register_decode_attention()
        ids, mask = left_pad([list(p) for p in prompt_ids], pad_id, device)
        B, P = ids.shape
        # one draw per rollout, whatever the waves: every row's sampling noise derives from it (row_noise)
        key = torch.randint(0, 2**32, (2,), generator=generator, device=device)
        wave_prompts = wave_prompts_of(B, group_size, self.wave_rows)
        if self.kv_cache_dtype == "fp8_e4m3" and decoder is not None and decoder.fast \
                and torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError(f"model.rollout.init_args.kv_cache_dtype=fp8_e4m3 needs a GPU of compute capability "
                             f">= 8.9 (Ada, Hopper) for the fused decode step; {torch.cuda.get_device_name(device)} "
                             f"is {torch.cuda.get_device_capability(device)}. Use kv_cache_dtype=auto.")
        # one walk of the module tree; a fused MoE step reads its experts from its own stacks (``MoEStep.prepare``
        # copies their LoRA, and restacks moved weights, which changes ``decoder.key``): nearly all modules, unvisited
        params = parameters_outside_experts(policy) if decoder is not None and decoder.moe \
            else list(policy.named_parameters())
        s = self._ensure_state(policy, base, params, wave_prompts * group_size, P + columns, new, spec, device,
                               decoder)
        # dropout off for the transformers forward (the fused step has none); walking the module tree twice to switch
        # modes costs host time per rollout, so the fused path leaves them as they are
        was_training = policy.training and decoder is None
        if was_training:
            policy.eval()
        try:
            with noisy_norms(policy, spec.noise_sigma, spec.noise_generator), decode_attention(base.config), \
                    self._adapter_copies(policy, params, base.get_input_embeddings().weight.dtype):
                if decoder is not None:
                    dtype = base.get_input_embeddings().weight.dtype
                    rows = wave_prompts * group_size
                    decoder.prepare(dtype, dequantize=self._wide_batch_bf16(decoder, rows, dtype, device), rows=rows,
                                    record=routing is not None)
                    self._graph_cache.drop_stale(decoder.key)
                s.noise_key.copy_(key)
                yield s, ids, mask, [(slice(first, min(B, first + wave_prompts)), first * group_size)
                                     for first in range(0, B, wave_prompts)]
        finally:
            self._routing = None
            if was_training:
                policy.train()
            if decoder is not None:
                decoder.release()
            if not self.keep_kv_cache:
                s.cache.release()  # for the update

    def _start_wave(self, s: DecodeState, policy, ids, mask, group_size: int, pad_id: int, eos_ids: list[int],
                    first_row: int, spec: SamplingSpec) -> tuple[list[int], torch.Tensor]:
        """Prefill the prompts ``ids`` (output rows ``first_row`` on) into the state's first slots; returns the batch
        buckets of the wave and the logits [B*G, V] of each row's first token."""
        B, P = ids.shape
        N, device = B * group_size, ids.device
        if s.cache.allocate():  # again, after the last rollout released it, at another address
            self._clear_graphs()
        s.reset(mask, group_size, pad_id, eos_ids, spec.max_new_tokens)
        s.first_row.fill_(first_row)
        self._phase("prefill")
        decoder, cache = s.decoder, s.cache
        cache.start_prefill()
        m4 = (torch.ones(P, P, dtype=torch.bool, device=device).tril()[None] & mask.bool()[:, None, :])
        m4 = (m4 | torch.eye(P, dtype=torch.bool, device=device)[None])[:, None]  # [B, 1, P, P]
        if self._routing is not None:  # a prompt's prefill serves the G rows of its group
            self._routing.place(first_row + torch.arange(N, device=device).view(B, group_size),
                                torch.arange(P, device=device))
        with sdpa_kernel(SDPA_KERNELS):  # (each wave's prompts come in a new shape)
            if decoder is not None:
                logits = decoder.prefill(ids, position_ids(mask), cache.keys, cache.values, m4)
                if decoder.prefill_choices is not None:  # (a MoE, recording)
                    self._routing.add(decoder.prefill_choices)
            else:
                logits = policy(input_ids=ids, attention_mask=m4, position_ids=position_ids(mask),
                                past_key_values=s.hf_cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        cache.repeat_rows(B, group_size, P)
        return sorted({N} | {2**k for k in range(int(math.log2(max(N, 1))) + 1) if self.min_bucket <= 2**k < N}), \
            logits.repeat_interleave(group_size, 0)

    def _decode_wave(self, s: DecodeState, policy, ids, mask, group_size: int, pad_id: int, eos_ids: list[int],
                     first_row: int, spec: SamplingSpec) -> int:
        """Prefill and decode the prompts ``ids`` (output rows ``first_row`` on) in the state's first slots; returns
        the decode steps run (the columns of ``s.tokens_out`` written)."""
        P, N = ids.shape[1], ids.shape[0] * group_size
        buckets, logits = self._start_wave(s, policy, ids, mask, group_size, pad_id, eos_ids, first_row, spec)
        self._record(s, logits, N, spec)
        del logits
        self._phase("decode")
        b, steps = N, 1
        while steps < self._decode_limit(spec.max_new_tokens):
            if steps % self.check_every == 0:
                self._phase("check", steps - 1)
                alive = int((~s.finished[:b]).sum())  # host sync, once every check_every steps
                if alive == 0:
                    break
                smaller = next(x for x in buckets if x >= alive)
                if smaller < b:
                    s.compact(b, P + steps - 1)
                    b = smaller
            length = self._attended(s, P + steps)
            self.costs.step(b, length)
            self._run_step(s, policy, b, length, spec)
            steps += 1
        return steps

    def _attended(self, s: DecodeState, columns: int) -> int:
        """The cache columns a step attends to when ``columns`` hold tokens (its length bucket)."""
        return min(s.length, -(-columns // self.length_bucket) * self.length_bucket)

    # ------------------------------------------------------------------------------------------------------------
    # The engine's seams: what it picks by itself, one method each (a benchmark's subclass compares the alternatives,
    # ``qerl.testing.comparison_rollout``).
    def _captures(self, device) -> bool:
        """Whether the decode steps run from captured CUDA graphs (on CUDA; eagerly elsewhere)."""
        return device.type == "cuda"

    def _kernels(self, device) -> Kernels:
        """The fused step's kernels on ``device``, picked once (PDL and the wgmma GEMV where supported)."""
        return Kernels.pick(device)

    def _sample(self, logits, spec: SamplingSpec, key, rows, step):
        """The draw of one step (the fused sampling kernels where they apply)."""
        return sample_rows(logits, spec.temperature, spec.top_p, key, rows, step)

    def _decode_limit(self, max_new_tokens: int) -> int:
        """Tokens to decode at most (the spec's ``max_new_tokens``)."""
        return max_new_tokens

    def _phase(self, name: str, decode_steps: int = 0) -> None:
        """Told each phase of a call and the decode steps run so far ("prefill", "decode", "done"; "capture" /
        "captured" around each captured step; "check" before each check's sync): nothing to do here."""

    def _fused_decoder(self, base, device):
        from qerl.rollout.fused_decoder import FusedDecoder, Unsupported

        if not (device.type == "cuda" if self.fused is None else self.fused):
            return None
        kernels = self._kernels(device)
        if self._decoder is not None and self._decoder[0] == (id(base), kernels):
            return self._decoder[1]
        try:
            decoder = FusedDecoder(base, kernels)
        except Unsupported as e:
            warnings.warn(f"CUDAGraphRollout: fused decoding off for this model ({e}); decoding with the transformers "
                          f"step, many times slower per token (it launches thousands of kernels a token).")
            decoder = None
        self._decoder = ((id(base), kernels), decoder)
        return decoder

    @property
    def graphs_captured(self) -> int:
        """Decode steps captured over the engine's life (recaptures count)."""
        return self._graph_cache.captured

    def _clear_graphs(self) -> None:
        self._graph_cache.clear()

    def _wide_batch_bf16(self, decoder, rows: int, dtype, device) -> bool:
        """Whether this rollout decodes its wide steps on a bf16 copy: as ``wide_batch_bf16`` says, where there are
        wide steps and NVFP4 weights to copy, on CUDA."""
        on_cuda = 0 if device.type == "cuda" else None  # (the setting is decided: no free memory to weigh)
        return wants_bf16_copy(self.wide_batch_bf16, rows, decoder.dequantized_bytes(dtype, rows), on_cuda)

    def _adapter_copies(self, policy, params: list, dtype):
        """The LoRA matrices in ``dtype`` for the rollout, where ``adapter_in_model_dtype``."""
        return self._adapters.swapped_in(policy, params, dtype) if self.adapter_in_model_dtype else nullcontext()

    def _ensure_state(self, policy, base, params: list, rows: int, length: int, new: int, spec: SamplingSpec,
                      device, decoder) -> DecodeState:
        """Buffers (and graphs) are kept while requests fit them and the parameters keep their storage (and the step
        its ``decoder``: None for the transformers step)."""
        config = base.config
        length = -(-length // self.length_bucket) * self.length_bucket
        pointers = tuple(p.data_ptr() for _, p in params)
        dtype = base.get_input_embeddings().weight.dtype
        kv_dtype = cache_dtype(self.kv_cache_dtype, dtype)
        key = (pointers, spec.top_p, id(policy), kv_dtype, decoder)
        s = self._state
        if s is not None and s.key == key and s.rows >= rows and s.length >= length \
                and s.tokens_out.shape[1] >= new:
            return s
        self._clear_graphs()
        self._state = None
        if s is not None:  # keep the larger of the old and new sizes so alternating requests do not thrash
            if s.key == key:
                rows, length, new = max(rows, s.rows), max(length, s.length), max(new, s.tokens_out.shape[1])
            del s
            if device.type == "cuda":
                torch.cuda.empty_cache()
        shape = (config.num_hidden_layers, rows, config.num_key_value_heads, length, head_dim(config))
        cache = SlotCache(*shape, kv_dtype, device, allocate=False)  # allocated by each wave (see _decode_wave)
        s = DecodeState.empty(key, cache, new, device, decoder, feed_width=self.feed_observation_tokens - 1)
        self._state = s
        if device.type == "cuda":
            self._graph_cache.new_pool()
        return s

    def _record(self, s: DecodeState, logits: torch.Tensor, b: int, spec: SamplingSpec, first: int = 0) -> None:
        """Sample the next token of slots ``first``..b-1 and write it, its log-prob and entropy at each slot's column
        ``col``; a slot stops at an EOS or at its turn's ``limit``, and then writes padding without moving on. In an
        episode call a slot being fed (``DecodeState.start_feeding``) takes its next fed token instead and writes
        nothing, its column stays."""
        slots = slice(first, b)
        rows = s.first_row + s.slot_row[slots]  # output rows: the noise follows the row, not its slot or wave
        col = s.col[slots]
        key = None if spec.greedy else s.noise_key
        token, logprob, entropy = self._sample(logits, spec, key, rows, col)
        done = s.finished[slots]
        token = torch.where(done, s.pad, token)
        silent, written = done, token
        if self._feeding:  # (only episode calls: a single-turn step's graph has none of these kernels)
            at = s.feed_at[slots]
            fed = at < s.feed_end[slots]
            token = torch.where(fed, s.feed[slots].gather(1, at.clamp(max=s.feed.shape[1] - 1)[:, None])[:, 0], token)
            at += fed.long()
            silent = done | fed
            written = torch.where(fed, s.pad, token)
        index = (s.slot_row[slots], col)
        s.tokens_out.index_put_(index, written)
        s.logprobs_out.index_put_(index, logprob.masked_fill(silent, 0.0))
        s.entropy_out.index_put_(index, entropy.masked_fill(silent, 0.0))
        col += (~silent).long()
        ends = torch.isin(token, s.eos) | (col >= s.limit[slots])
        done |= ends & ~fed if self._feeding else ends
        s.last[slots] = token

    def _step(self, s: DecodeState, policy, b: int, length: int, spec: SamplingSpec) -> None:
        """One decode step of slots 0..b-1 attending to cache columns 0..length-1; only device work, graph-safe."""
        cache = s.cache
        cache.start_decode(b, length)
        mask = s.mask[:b]
        # the fed token is context for the running slots only: a stopped slot keeps its position and its turn-ending
        # token is appended with its observation (episode_wave); what it writes meanwhile is never attended
        running = ~s.finished[:b]
        mask[:, 0, 0].index_copy_(1, cache.position, running[:, None])
        if s.decoder is not None:
            logits = s.decoder.step(s.last[:b], s.pos[:b], cache.keys, cache.values, cache.position,
                                    mask[:, 0, 0], length, idle=s.finished[:b])
        else:
            if self._routing is not None:  # the slots' rows, at the cache column of the token they feed
                self._routing.place(s.first_row + s.slot_row[:b], cache.position, running)
            out = policy(input_ids=s.last[:b, None], attention_mask=mask[:, :, :, :length],
                         position_ids=s.pos[:b, None], past_key_values=s.hf_cache, use_cache=True,
                         logits_to_keep=1)
            logits = out.logits[:, -1]
        self._record(s, logits, b, spec)
        s.pos[:b] += running.long()
        cache.position += 1

    def _run_step(self, s: DecodeState, policy, b: int, length: int, spec: SamplingSpec) -> None:
        decoder, graphs = s.decoder, self._graphs
        # an idle row feeds a token with its own column masked: its expert choices are not the rollout's
        running = ~s.finished[:b] if self._routing is not None and decoder is not None and decoder.moe else None
        # the spec's sampling values are baked into a capture: evaluation's (greedy, another temperature) get their own
        graph_key = GraphKey(b, length, spec.temperature, spec.greedy, self._feeding,
                             decoder.key(b) if decoder is not None else None)
        graph = self._graph_cache.get(graph_key) if graphs else None
        if graph is not None:
            graph.replay()
        else:
            if graphs:
                self._phase("capture")
            self._step(s, policy, b, length, spec)  # eager: the step itself, and the warm-up before a capture
            if graphs:
                self._graph_cache.capture(graph_key, lambda: self._step(s, policy, b, length, spec))
                self._phase("captured")
        if self._routing is not None and decoder is not None and decoder.moe:  # the fused step wrote its choices
            self._routing.place(s.first_row + s.slot_row[:b], s.cache.position - 1, running)
            self._routing.add(decoder.step_choices(b))
