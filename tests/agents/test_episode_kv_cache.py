"""The CUDA-graph engine plays episodes in its KV cache: each prompt is prefilled once, later only the observations
(with the turn-ending token they follow), never a whole context again; its samples do not depend on the waves, the
checks or the other rows' turns; tools run while the other rows decode; with greedy decoding it writes what
resubmitting the contexts writes; a wave whose columns run out packs each row's columns and goes on."""

import time

import pytest
import torch

from qerl.agents.config import AgentConfig
from qerl.agents.episode import run_episodes
from qerl.rollout import cuda_graph
from qerl.rollout.cuda_graph import CUDAGraphRollout
from qerl.rollout.decode_state import DecodeState
from qerl.rollout.episodes import BoundEngine
from qerl.rollout.kv_cache import SlotCache
from qerl.rollout.sampling_spec import SamplingSpec
from qerl.testing.rollouts import recompute
from qerl.testing.tiny_agents import chat_prompts
from qerl.tools.environment import EnvironmentFactory

QUESTIONS = ["Say hi.", "Count to three.", "Name a colour."]


class Replies:
    """Answers a row's first ``replies`` turns (its dataset column), then ends: rows end at different turns."""

    def reset(self, replies: int = 1, **row) -> None:
        self.replies, self.left = 0, replies

    def step(self, message: str) -> str | None:
        self.replies += 1
        return None if self.replies > self.left else f"Next ({self.replies})."


class GrowingReplies(Replies):
    """Replies that grow a word a turn: observation blocks of several lengths."""

    def step(self, message: str) -> str | None:
        reply = super().step(message)
        return None if reply is None else reply + " More" * self.replies


def play(chat_model, engine, max_new_tokens=8, greedy=False, config=None, sample=None, environment=Replies):
    policy, tokenizer = chat_model
    eos, pad = [tokenizer.eos_token_id], tokenizer.pad_token_id
    spec = SamplingSpec(max_new_tokens=max_new_tokens, temperature=0.7, seed=5, greedy=greedy)
    player = sample or BoundEngine(engine, policy, pad, eos, spec)
    return run_episodes(player, chat_prompts(tokenizer, QUESTIONS), [{"replies": r} for r in (0, 1, 3)], 3,
                        tokenizer, eos, pad, config or AgentConfig(max_turns=5), [], EnvironmentFactory(environment),
                        max_new_tokens, "qwen")


def test_prompt_prefilled_once_then_observations_only(chat_model):
    policy, tokenizer = chat_model
    inputs = []  # every forward's token ids: one token per row is a decode step, more a prefill
    embed = policy.get_base_model().get_input_embeddings()
    hook = embed.register_forward_pre_hook(lambda module, args: inputs.append(args[0].clone()))
    try:
        episodes = play(chat_model, CUDAGraphRollout(check_every=3, feed_observation_tokens=0))
    finally:
        hook.remove()
    prefills = [ids for ids in inputs if ids.shape[1] > 1]
    prompts = chat_prompts(tokenizer, QUESTIONS)
    assert tuple(prefills[0].shape) == (len(prompts), max(map(len, prompts)))  # each prompt once, for its G rows
    trajectories = episodes.trajectories
    observations = [[tok for tok, model in zip(t.tokens, t.generated) if not model] for t in trajectories]
    assert len({t.turns for t in trajectories}) > 1  # rows end at different turns
    # then only appended blocks: one per continued turn, each the turn's last token + the observation, never a context
    assert sum(ids.shape[0] for ids in prefills[1:]) == sum(t.turns - 1 for t in trajectories) > 0
    assert max(ids.shape[1] for ids in prefills[1:]) <= 1 + max(map(len, observations)) < min(map(len, prompts))


def test_fed_observations_keep_the_samples_and_launch_no_prefill(chat_model):
    """A resumed row's block (the turn's last token + the observation) fed through the decode steps, a token per step,
    samples what the prefilled block samples; only blocks longer than ``feed_observation_tokens`` are prefilled."""
    policy, _ = chat_model
    widths = []  # every forward's tokens per row: 1 is a decode step, more a prefill
    embed = policy.get_base_model().get_input_embeddings()
    hook = embed.register_forward_pre_hook(lambda module, args: widths.append(args[0].shape[1]))
    runs = {}
    try:
        for feed in (0, 64, 16):
            widths.clear()
            engine = CUDAGraphRollout(check_every=3, feed_observation_tokens=feed)
            runs[feed] = play(chat_model, engine, environment=GrowingReplies), widths[1:]
    finally:
        hook.remove()
    (prefilled, prefills), (fed, none), (split, some) = runs[0], runs[64], runs[16]
    # each observation's block: the turn's last token + the observation (a run of the completion's non-model tokens)
    blocks = sorted({1 + len(run) for t in fed.trajectories
                     for run in "".join(map(str, t.generated)).split("1") if run})
    assert max(t.turns for t in fed.trajectories) >= 2 and blocks[0] <= 16 < blocks[-1]
    assert set(none) == {1} and max(prefills) > 1  # fed: the prompts' prefill is the only one
    assert set(some) - {1} and min(set(some) - {1}) > 16 and len(some) - some.count(1) < len(prefills) - prefills.count(1)
    for other in (fed, split):
        assert torch.equal(other.rollout.completion_ids, prefilled.rollout.completion_ids)
        torch.testing.assert_close(other.rollout.logprobs, prefilled.rollout.logprobs, atol=2e-5, rtol=0)
        torch.testing.assert_close(other.rollout.entropy, prefilled.rollout.entropy, atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="feed_observation_tokens=-1 must be >= 0"):
        CUDAGraphRollout(feed_observation_tokens=-1)


def test_lagged_checks_keep_the_samples_and_do_their_host_work_behind_the_lag_steps(chat_model, monkeypatch):
    """A check reads the rows' state, launches ``check_lag_steps`` more decode steps, then does its host work: the
    samples and log-probs are those of checks without lag steps."""
    from qerl.rollout import episode_wave

    policy, _ = chat_model
    forwards, gaps = [], []  # per check: the forwards launched between its state read and its host work
    embed = policy.get_base_model().get_input_embeddings()
    hook = embed.register_forward_pre_hook(lambda module, args: forwards.append(args[0].shape[1]))
    read, between = episode_wave.EpisodeWave._read_state, episode_wave.EpisodeWave._between_turns
    monkeypatch.setattr(episode_wave.EpisodeWave, "_read_state", lambda wave: gaps.append(len(forwards)) or read(wave))

    def host_work(wave, *args):
        gaps[-1] = len(forwards) - gaps[-1]
        return between(wave, *args)

    monkeypatch.setattr(episode_wave.EpisodeWave, "_between_turns", host_work)
    try:
        plain = play(chat_model, CUDAGraphRollout(check_every=4, check_lag_steps=0))
        assert set(gaps) == {0}
        gaps.clear()
        lagged = play(chat_model, CUDAGraphRollout(check_every=4, check_lag_steps=2))
    finally:
        hook.remove()
    assert gaps and set(gaps) == {2}
    assert max(t.turns for t in lagged.trajectories) >= 2
    assert torch.equal(plain.rollout.completion_ids, lagged.rollout.completion_ids)
    torch.testing.assert_close(plain.rollout.logprobs, lagged.rollout.logprobs, atol=2e-5, rtol=0)
    assert CUDAGraphRollout(check_every=3, check_lag_steps=5).check_lag_steps == 2
    with pytest.raises(ValueError, match="check_lag_steps=-1 must be >= 0"):
        CUDAGraphRollout(check_lag_steps=-1)


class WaitsForTheDecode:
    """Its first reply waits until the engine has decoded another step (in the test's ``forwards``): the tools run
    beside the decode of the other rows, not instead of it."""

    forwards: list = []
    saw_decode: list = []

    def reset(self, **row) -> None:
        self.replies = 0

    def step(self, message: str) -> str | None:
        self.replies += 1
        if not self.saw_decode:
            seen, deadline = len(self.forwards), time.monotonic() + 60
            while len(self.forwards) == seen and time.monotonic() < deadline:
                time.sleep(0.001)
            self.saw_decode.append(len(self.forwards) > seen)
        return "Next." if self.replies < 2 else None


def test_tools_run_while_the_other_rows_decode(chat_model):
    policy, tokenizer = chat_model
    WaitsForTheDecode.forwards, WaitsForTheDecode.saw_decode = [], []
    embed = policy.get_base_model().get_input_embeddings()
    hook = embed.register_forward_pre_hook(lambda module, args: WaitsForTheDecode.forwards.append(1))
    eos, pad = [tokenizer.eos_token_id], tokenizer.pad_token_id
    spec = SamplingSpec(max_new_tokens=8, temperature=0.7, seed=5)
    try:
        episodes = run_episodes(BoundEngine(CUDAGraphRollout(check_every=2), policy, pad, eos, spec),
                                chat_prompts(tokenizer, QUESTIONS), [{}] * 3, 3, tokenizer, eos, pad,
                                AgentConfig(max_turns=5), [], EnvironmentFactory(WaitsForTheDecode), 8, "qwen")
    finally:
        hook.remove()
    assert WaitsForTheDecode.saw_decode and all(WaitsForTheDecode.saw_decode)  # (the first batch's calls run at once)
    assert max(t.turns for t in episodes.trajectories) >= 2


def test_samples_independent_of_waves_and_checks(chat_model):
    one = play(chat_model, CUDAGraphRollout(check_every=3), max_new_tokens=4)
    waves = play(chat_model, CUDAGraphRollout(check_every=5, wave_rows=3, min_bucket=2), max_new_tokens=4)
    assert {t.end for t in one.trajectories} >= {"length", "environment"}  # cut turns and answered ones
    assert torch.equal(one.rollout.completion_ids, waves.rollout.completion_ids)
    torch.testing.assert_close(one.rollout.logprobs, waves.rollout.logprobs, atol=1e-5, rtol=0)
    assert [t.turns for t in one.trajectories] == [t.turns for t in waves.trajectories]


def test_greedy_episode_equals_resubmitting_contexts(chat_model):
    policy, tokenizer = chat_model
    engine = CUDAGraphRollout(check_every=3)
    appended = play(chat_model, engine, greedy=True)
    spec = SamplingSpec(max_new_tokens=8, temperature=0.7, seed=5, greedy=True)

    def resubmit(contexts, samples, max_new_tokens):
        return engine.generate(policy, contexts, samples, tokenizer.pad_token_id, [tokenizer.eos_token_id],
                               SamplingSpec(**{**vars(spec), "max_new_tokens": max_new_tokens}))

    resubmitted = play(chat_model, engine, greedy=True, sample=resubmit)
    assert max(t.turns for t in appended.trajectories) >= 3
    assert torch.equal(appended.rollout.completion_ids, resubmitted.rollout.completion_ids)
    torch.testing.assert_close(appended.rollout.logprobs, resubmitted.rollout.logprobs, atol=2e-5, rtol=0)


# fed blocks take a column a step as decoding rows do: that cache never runs out, so packing at every check (no holes
# allowed) moves their columns while they are being fed
@pytest.mark.parametrize("feed, holes", [(0, 256), (64, 0)], ids=["prefilled", "fed"])
def test_wave_out_of_columns_defragments_and_stays_exact(chat_model, monkeypatch, feed, holes):
    policy, tokenizer = chat_model
    packs, real = [], DecodeState.defragment
    monkeypatch.setattr(DecodeState, "defragment", lambda s, b, written: packs.append(written) or real(s, b, written))
    # a cache shorter than the engine sizes it (its worst case), so that this short episode runs out of columns
    monkeypatch.setattr(cuda_graph, "episode_columns", lambda budget, check_every: budget + 10 * check_every)
    limit = max(map(len, chat_prompts(tokenizer, QUESTIONS))) + 40
    engine = CUDAGraphRollout(check_every=2, length_bucket=1, feed_observation_tokens=feed, max_hole_columns=holes)
    episodes = play(chat_model, engine, config=AgentConfig(max_turns=5, max_episode_tokens=limit))
    assert packs  # the columns were packed at least once
    r, generated = episodes.rollout, episodes.rollout.model_mask.bool()
    lp, entropy = recompute(policy, r, 0.7)
    torch.testing.assert_close(r.logprobs, lp * generated, atol=2e-5, rtol=0)
    torch.testing.assert_close(r.entropy, entropy * generated, atol=2e-5, rtol=0)


def test_defragment_packs_each_rows_columns_in_order():
    cache = SlotCache(layers=2, rows=3, kv_heads=1, length=8, head_dim=2, dtype=torch.float32, device="cpu")
    for t in (*cache.keys, *cache.values):
        t.copy_(torch.randn(t.shape))
    before = [t.clone() for t in (*cache.keys, *cache.values)]
    s = DecodeState.empty(("test",), cache, 4, "cpu")
    kept = torch.tensor([[1, 0, 1, 1, 0, 0, 1, 0], [0, 0, 0, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0]]).bool()
    s.mask[:, 0, 0] = kept
    assert s.defragment(3, 7) == 6
    for old, new in zip(before, (*cache.keys, *cache.values)):
        for row in range(3):
            columns = [c for c in range(7) if kept[row, c]]
            assert torch.equal(new[row, :, :len(columns)], old[row, :, columns])
    assert s.mask[:, 0, 0, :7].sum(-1).tolist() == [4, 2, 6] and not s.mask[1, 0, 0, 2:].any()
    assert torch.equal(s.mask[:, 0, 0, 7], kept[:, 7])  # columns past the written ones untouched


class DecodeReads:
    """Records what each decode step of the transformers step reads (a forward of one token per row): with a length
    bucket of 1 the mask's last column is the step's own, True for the rows that decode."""

    def __init__(self):
        self.attended = self.needed = self.decoded = self.steps = 0
        self.max_width = 0  # the widest observation block

    def __call__(self, module, args, kwargs):
        ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
        if ids.shape[1] > 1:
            self.max_width = max(self.max_width, ids.shape[1])
            return
        mask = mask[:, 0, 0]  # [b, L]
        running = mask[:, -1]
        self.steps += 1
        self.attended += mask.numel()
        self.decoded += int(running.sum())
        self.needed += int(mask[running].sum())


@pytest.mark.parametrize("feed, lag", [(0, 0), (64, 0), (0, 2), (64, 2)], ids=["prefilled", "fed", "prefilled-lagged",
                                                                            "fed-lagged"])
def test_costs_count_what_the_decode_steps_read(chat_model, feed, lag):
    policy, _ = chat_model
    # check_every=2, 16 new tokens: turns end apart, so rows resume while others run (after one lead step)
    for holes, check_every, new in ((None, 3, 8), (0, 3, 8), (None, 2, 16)):
        reads = DecodeReads()
        engine = CUDAGraphRollout(check_every=check_every, length_bucket=1, max_hole_columns=holes,
                                  feed_observation_tokens=feed, check_lag_steps=lag)
        hook = policy.get_base_model().register_forward_pre_hook(reads, with_kwargs=True)
        try:
            episodes = play(chat_model, engine, max_new_tokens=new)
        finally:
            hook.remove()
        costs = engine.costs
        assert (costs.decode_steps, costs.attended, costs.needed, costs.decoded + costs.fed) == \
            (reads.steps, reads.attended, reads.needed, reads.decoded)
        observed = sum(not model for t in episodes.trajectories for model in t.generated)
        blocks = sum(t.turns - 1 for t in episodes.trajectories)  # each the turn's last token + the observation
        assert observed > 0 and (costs.fed, costs.prefill_tokens) == \
            ((observed, 0) if feed else (0, observed + blocks))


def test_eager_packing_keeps_the_samples_and_bounds_the_holes(chat_model):
    policy, _ = chat_model
    lazy = CUDAGraphRollout(check_every=3, length_bucket=1, max_hole_columns=None)
    reads, eager = DecodeReads(), CUDAGraphRollout(check_every=3, length_bucket=1, max_hole_columns=2)
    hook = policy.get_base_model().register_forward_pre_hook(reads, with_kwargs=True)
    try:
        packed = play(chat_model, eager)
    finally:
        hook.remove()
    one = play(chat_model, lazy)
    assert lazy.costs.packs == 0 < eager.costs.packs and eager.costs.attended < lazy.costs.attended
    # holes beyond the margin last until the next check at most: the block appended there and its steps
    assert 2 < lazy.costs.excess and eager.costs.excess <= 2 + reads.max_width + 3
    assert torch.equal(one.rollout.completion_ids, packed.rollout.completion_ids)
    r, generated = packed.rollout, packed.rollout.model_mask.bool()
    lp, entropy = recompute(policy, r, 0.7)
    torch.testing.assert_close(r.logprobs, lp * generated, atol=2e-5, rtol=0)
    torch.testing.assert_close(r.entropy, entropy * generated, atol=2e-5, rtol=0)


def test_turn_check_interval_keeps_the_samples_and_shortens_the_idle_steps(chat_model):
    one, often = CUDAGraphRollout(check_every=6), CUDAGraphRollout(check_every=6, turn_check_every=2)
    a, b = play(chat_model, one), play(chat_model, often)
    assert torch.equal(a.rollout.completion_ids, b.rollout.completion_ids)
    torch.testing.assert_close(a.rollout.logprobs, b.rollout.logprobs, atol=1e-5, rtol=0)
    assert 0 < often.costs.waiting < one.costs.waiting <= one.costs.row_steps - one.costs.decoded
    with pytest.raises(ValueError, match="turn_check_every=0 must be >= 1"):
        CUDAGraphRollout(check_every=6, turn_check_every=0)


def test_finer_turn_buckets_keep_the_samples_and_drop_idle_rows(chat_model):
    powers, every = CUDAGraphRollout(check_every=2), CUDAGraphRollout(check_every=2, turn_bucket_rows=1)
    a, b = play(chat_model, powers), play(chat_model, every)
    assert torch.equal(a.rollout.completion_ids, b.rollout.completion_ids)
    torch.testing.assert_close(a.rollout.logprobs, b.rollout.logprobs, atol=1e-5, rtol=0)
    assert every.costs.row_steps < powers.costs.row_steps and every.costs.decoded == powers.costs.decoded
