import math

import pytest
import torch
import torch.nn.functional as F

from lightning_llmopt.data import ByteTokenizer, ResumableDataLoader, ResumableShardedSampler
from lightning_llmopt.data.chunks import ChunkDataset
from lightning_llmopt.data.curriculum import (
    CurriculumSampler,
    CurriculumSamplerFactory,
    count_syllables,
    difficulty_ranks,
    flesch_kincaid_grade,
    length_scores,
    lexical_diversity_scores,
    linear,
    readability_scores,
    reference_loss_scores,
    root,
    score_dataset,
    seq_len_schedule,
    staged,
)

# ---------------------------------------------------------------- scorers against hand-computed values


def test_length_counts_longest_document_piece_and_skips_padding() -> None:
    eos, pad = 9, 0
    ids = torch.tensor([[1, 2, eos, 3, 4, 5, eos, 6], [1, 2, 3, 4, 5, 6, 7, 8], [7, 7, 7, pad, pad, pad, pad, pad]])
    assert length_scores(ids, eos_id=eos).tolist() == [3.0, 8.0, 8.0]
    assert length_scores(ids, pad_id=pad).tolist() == [8.0, 8.0, 3.0]
    assert length_scores(ids, pad_id=pad, eos_id=eos).tolist() == [3.0, 8.0, 3.0]
    assert length_scores(ids).tolist() == [8.0, 8.0, 8.0]  # no ids to split on: every sample has length T


def test_lexical_diversity_is_type_token_ratio() -> None:
    ids = torch.tensor([[1, 1, 2, 3], [4, 4, 4, 4], [5, 6, 0, 0], [0, 0, 0, 0]])
    assert lexical_diversity_scores(ids).tolist() == [3 / 4, 1 / 4, 3 / 4, 1 / 4]
    assert lexical_diversity_scores(ids, pad_id=0).tolist() == [3 / 4, 1 / 4, 2 / 2, 0.0]


@pytest.mark.parametrize(
    ("word", "syllables"),
    [("the", 1), ("cat", 1), ("make", 1), ("table", 2), ("reading", 2), ("beautiful", 3), ("rhythm", 1), ("x", 1)],
)
def test_syllables_are_vowel_groups(word: str, syllables: int) -> None:
    assert count_syllables(word) == syllables


def test_flesch_kincaid_grade_by_hand() -> None:
    # 6 words, 2 sentences, 6 syllables: 0.39 * 3 + 11.8 * 1 - 15.59
    assert flesch_kincaid_grade("The cat sat. The dog ran.") == pytest.approx(0.39 * 3 + 11.8 - 15.59)
    # 3 words (2 + 3 + 2 syllables), 1 sentence
    assert flesch_kincaid_grade("Reading beautiful tables!") == pytest.approx(0.39 * 3 + 11.8 * 7 / 3 - 15.59)
    assert flesch_kincaid_grade("no end mark") == pytest.approx(0.39 * 3 + 11.8 - 15.59)  # counts as 1 sentence
    assert flesch_kincaid_grade("123 + 456 ...") == 0.0


def test_readability_decodes_each_sample() -> None:
    tok = ByteTokenizer()
    texts = ["The cat sat. The dog ran.", "Reading beautiful tables!"]
    width = max(len(t) for t in texts)
    ids = torch.tensor([tok.encode(t.ljust(width)) for t in texts])
    assert readability_scores(ids, tok).tolist() == pytest.approx([flesch_kincaid_grade(t) for t in texts])


def test_reference_loss_is_per_sample_mean_cross_entropy() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11))
    ids = torch.randint(0, 11, (5, 7))
    labels = torch.randint(0, 11, (5, 7))
    labels[1, 3:] = -100
    scores = reference_loss_scores({"input_ids": ids, "labels": labels}, model)
    for i in range(5):  # one sample at a time, torch's own mean over the kept labels
        keep = labels[i] != -100
        expected = F.cross_entropy(model(ids[i : i + 1])[0][keep], labels[i][keep])
        assert scores[i].item() == pytest.approx(expected.item(), rel=1e-5)  # fp32 sums in a different order
    assert not scores.requires_grad and model.training  # no graph kept, training flag restored
    shifted = reference_loss_scores({"input_ids": ids}, model)  # no labels: predict ids[:, 1:]
    direct = F.cross_entropy(model(ids[:, :-1]).transpose(1, 2), ids[:, 1:], reduction="none").mean(1)
    assert torch.allclose(shifted, direct.double(), rtol=1e-5)


def test_ranks_are_ordinal_in_unit_interval_and_break_ties_by_seed() -> None:
    assert difficulty_ranks(torch.tensor([3.0, 1.0, 2.0])).tolist() == [1.0, 0.0, 0.5]
    scores = torch.tensor([2.0, 1.0, 2.0, 2.0, 0.0, 1.0])
    ranks = difficulty_ranks(scores, seed=3)
    assert sorted(ranks.tolist()) == [i / 5 for i in range(6)]
    for i in range(6):
        for j in range(6):
            if scores[i] < scores[j]:
                assert ranks[i] < ranks[j]
    tie_orders = {tuple(difficulty_ranks(scores, seed=s).tolist()) for s in range(8)}
    assert len(tie_orders) > 1  # ties are not always resolved by index


def test_score_dataset_fast_path_matches_item_path() -> None:
    chunks = torch.randint(0, 258, (37, 9), generator=torch.Generator().manual_seed(1))
    chunks[::5, 2] = 257
    dataset = ChunkDataset(chunks)
    as_items = [dataset[i] for i in range(len(dataset))]  # a plain list: goes through __getitem__ + collate
    for scorer in ("length", "lexical_diversity"):
        fast = score_dataset(dataset, scorer, eos_id=257, batch_size=10, normalize=False)
        slow = score_dataset(as_items, scorer, eos_id=257, batch_size=7, normalize=False)
        assert torch.equal(fast, slow)
    assert torch.equal(score_dataset(dataset, "length", eos_id=257, batch_size=4)[chunks[:, 2] == 257].sort().values,
                       score_dataset(dataset, "length", eos_id=257)[chunks[:, 2] == 257].sort().values)
    custom = score_dataset(dataset, lambda b: b["input_ids"][:, 0].float(), normalize=False)
    assert torch.equal(custom, chunks[:, 0].double())


def test_score_dataset_errors_name_the_problem() -> None:
    data = [torch.arange(4)] * 3
    with pytest.raises(ValueError, match="unknown scorer 'nope'"):
        score_dataset(data, "nope")
    with pytest.raises(ValueError, match="needs a tokenizer"):
        score_dataset(data, "readability")
    with pytest.raises(ValueError, match="reference model"):
        score_dataset(data, "reference_loss")
    with pytest.raises(ValueError, match="returned 1 scores for a batch of 3"):
        score_dataset(data, lambda b: torch.zeros(1))
    with pytest.raises(ValueError, match=r"non-finite score \(nan\) to sample 0"):
        score_dataset(data, lambda b: torch.full((3,), math.nan))


# ---------------------------------------------------------------- pacing


def test_pacing_values() -> None:
    lin = linear(0.1, 100)
    assert [lin(t) for t in (0, 50, 100, 500)] == pytest.approx([0.1, 0.55, 1.0, 1.0])
    sq = root(0.1, 100, p=2)
    assert [sq(t) for t in (0, 50, 100, 500)] == pytest.approx([0.1, math.sqrt(0.01 + 0.99 * 0.5), 1.0, 1.0])
    cube = root(0.2, 10, p=3)
    assert cube(5) == pytest.approx((0.008 + 0.992 * 0.5) ** (1 / 3))
    st = staged([(0, 0.25), (10, 0.5), (20, 1.0)])
    assert [st(t) for t in (0, 9, 10, 19, 20, 1000)] == [0.25, 0.25, 0.5, 0.5, 1.0, 1.0]


@pytest.mark.parametrize("pacing", [linear(0.05, 37), root(0.05, 37), root(0.3, 37, p=5), staged([(0, 0.1), (7, 1)])])
def test_pacing_is_monotone_in_range_and_reaches_one(pacing) -> None:
    values = [pacing(t) for t in range(60)]
    assert all(0 < v <= 1 for v in values)
    assert all(a <= b for a, b in zip(values, values[1:], strict=False))
    assert values[-1] == 1.0


def test_root_grows_faster_than_linear_early() -> None:
    lin, sq = linear(0.1, 100), root(0.1, 100)
    assert all(sq(t) > lin(t) for t in range(1, 100))


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: linear(0.0, 10), r"c0 \(0.0\)"),
        (lambda: root(0.1, 0), r"total_steps \(0\)"),
        (lambda: root(0.1, 10, p=0), r"p \(0\)"),
        (lambda: staged([(5, 0.5)]), "start at step 0"),
        (lambda: staged([(0, 0.5), (0, 0.6)]), "increase strictly, got 0 then 0"),
        (lambda: staged([(0, 0.5), (4, 0.4)]), "must not decrease, got 0.5 then 0.4"),
        (lambda: staged([(0, 1.5)]), r"fraction \(1.5\)"),
        (lambda: seq_len_schedule(64, 32, 10), r"end \(32\)"),
    ],
)
def test_bad_schedules_are_named(make, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_seq_len_schedule_values() -> None:
    s = seq_len_schedule(16, 128, warmup_steps=10)
    # 16 + 112 t / 10, rounded down to a multiple of 8
    assert [s(t) for t in (0, 3, 5, 9, 10, 50)] == [16, 48, 72, 112, 128, 128]
    assert seq_len_schedule(5, 30, 4, multiple_of=8)(0) == 8  # at least one multiple
    assert seq_len_schedule(5, 30, 4, multiple_of=8)(3) == 16  # 5 + 25 * 3 / 4 = 23.75
    assert seq_len_schedule(3, 6, 4)(0) == 6  # a multiple of 8 would exceed end: capped
    assert seq_len_schedule(64, 64, 0)(0) == 64
    values = [s(t) for t in range(12)]
    assert values == sorted(values) and all(v % 8 == 0 for v in values)


# ---------------------------------------------------------------- the sampler

N = 103


def _difficulty(seed: int = 0) -> torch.Tensor:
    return difficulty_ranks(torch.rand(N, generator=torch.Generator().manual_seed(seed)))


def test_acceptance_every_drawn_sample_is_within_competence() -> None:
    ranks = _difficulty()
    pacing = root(0.1, 30)
    sampler = CurriculumSampler(list(range(N)), ranks, pacing, global_batch_size=8, seed=4)
    assert sampler.steps_per_epoch == N // 8
    checked = 0
    for epoch in range(3):
        sampler.set_epoch(epoch)
        order = list(sampler)  # what the DataLoader gets
        assert order == sampler.permutation(epoch)[: sampler.usable].tolist()
        for g, index in enumerate(order[: sampler.steps_per_epoch * 8]):
            step = epoch * sampler.steps_per_epoch + g // 8
            assert ranks[index] <= pacing(step) + 1e-12, f"epoch {epoch} position {g}: rank above competence"
            checked += pacing(step) < 1
    assert checked > 100  # the schedule was active for a good part of the test
    early = ranks[sampler.permutation(0)[:40]].mean()
    assert early < 0.2 < ranks[sampler.permutation(2)].mean()  # easy first, the whole range later


def test_full_competence_reproduces_the_plain_sampler() -> None:
    ranks = _difficulty()
    ours = CurriculumSampler(list(range(N)), ranks, linear(1.0, 1), global_batch_size=4, seed=9)
    plain = ResumableShardedSampler(list(range(N)), seed=9)
    for epoch in (0, 1):
        ours.set_epoch(epoch)
        plain.set_epoch(epoch)
        assert list(ours) == list(plain)
    after = CurriculumSampler(list(range(N)), ranks, linear(0.1, 12), global_batch_size=4, seed=9)
    # steps >= 12 have full competence: from position 48 on the order is the plain one
    assert torch.equal(after.permutation(0)[48:], plain.permutation(0)[48:])
    assert not torch.equal(after.permutation(0)[:48], plain.permutation(0)[:48])


def test_no_repeats_within_a_step_and_order_is_deterministic() -> None:
    ranks = _difficulty()
    make = lambda seed: CurriculumSampler(list(range(N)), ranks, linear(0.2, 40), global_batch_size=8, seed=seed)  # noqa: E731
    perm = make(1).permutation(0)
    for s in range(N // 8):
        assert len(set(perm[8 * s : 8 * s + 8].tolist())) == 8
    assert torch.equal(perm, make(1).permutation(0))
    assert not torch.equal(perm, make(2).permutation(0))
    assert not torch.equal(perm, make(1).permutation(1))


def test_pool_smaller_than_step_draws_with_replacement() -> None:
    ranks = _difficulty()
    sampler = CurriculumSampler(list(range(N)), ranks, staged([(0, 0.02), (3, 1.0)]), global_batch_size=16)
    assert sampler.pool_size(0.02) == 3
    first = sampler.permutation(0)[:48]
    assert set(first.tolist()) <= set(sampler.order[:3].tolist())


def test_distributed_ranks_take_interleaved_slices_of_one_order() -> None:
    ranks = _difficulty()
    factory = CurriculumSamplerFactory(ranks, root(0.1, 20), batch_size=4)
    samplers = [factory(list(range(N)), num_replicas=2, rank=r, seed=3) for r in range(2)]
    assert samplers[0].global_batch_size == 8 and samplers[0].steps_per_epoch == (102 // 2) // 4
    assert torch.equal(samplers[0].permutation(0), samplers[1].permutation(0))
    shards = [list(s) for s in samplers]
    order = samplers[0].permutation(0)[: samplers[0].usable].tolist()
    assert shards[0] == order[0::2] and shards[1] == order[1::2]
    for b in range(len(shards[0]) // 4):  # the two ranks' micro-batches of one step are disjoint
        assert not set(shards[0][4 * b : 4 * b + 4]) & set(shards[1][4 * b : 4 * b + 4])


def test_factory_counts_optimizer_steps_like_lightning() -> None:
    factory = CurriculumSamplerFactory(_difficulty(), linear(0.1, 10), batch_size=4, accumulate_grad_batches=3)
    sampler = factory(list(range(N)), num_replicas=2, rank=0)
    # 51 samples per rank -> 12 batches -> ceil(12 / 3) = 4 optimizer steps of 2 * 4 * 3 = 24 samples
    assert (sampler.global_batch_size, sampler.steps_per_epoch) == (24, 4)
    assert sampler.step_of(2, 47) == 2 * 4 + 1


def test_mid_epoch_resume_through_the_loader_is_exact() -> None:
    data = torch.arange(N)
    factory = CurriculumSamplerFactory(_difficulty(), root(0.1, 25), batch_size=4)

    def loader() -> ResumableDataLoader:
        return ResumableDataLoader(data, batch_size=4, sampler=factory(data, seed=2), drop_last=True)

    full_loader = loader()
    full = []
    for epoch in range(2):
        full_loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        full += [b.tolist() for b in full_loader]
    first = loader()
    first.sampler.set_epoch(1)  # type: ignore[attr-defined]
    it = iter(first)
    seen = [next(it).tolist() for _ in range(5)]
    state = first.state_dict()
    assert state == {"epoch": 1, "consumed": 20, "world_size": 1, "batch_size": 4}
    second = loader()
    second.load_state_dict(state)
    assert seen + [b.tolist() for b in second] == full[len(full) // 2 :]


def test_sampler_errors_name_the_values() -> None:
    with pytest.raises(ValueError, match=r"shape \(5,\), expected \(103,\)"):
        CurriculumSampler(list(range(N)), torch.zeros(5), linear(), global_batch_size=4)
    with pytest.raises(ValueError, match=r"global_batch_size \(5\) must be a positive multiple of num_replicas \(2\)"):
        CurriculumSampler(list(range(N)), _difficulty(), linear(), global_batch_size=5, num_replicas=2)
    with pytest.raises(ValueError, match="NaN"):
        CurriculumSampler(list(range(N)), torch.full((N,), math.nan), linear(), global_batch_size=4)
    bad = CurriculumSampler(list(range(N)), _difficulty(), lambda step: 0.0, global_batch_size=4)
    with pytest.raises(ValueError, match=r"competence 0.0, outside \(0, 1\]"):
        bad.permutation(0)
