"""`specserve train data` and the trainers that read it, on the demo model (fast): held-out prompts share no
source with training ones; recorded states equal an unpadded forward of each conversation; --resume keeps
finished shards; the EAGLE3, draft and MTP trainers run on recorded data and write folders specserve loads."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from specserve.config import demo_model_dir
from specserve.models.config import ModelConfig
from specserve.models.eagle3 import load_eagle3_head, resolve_aux_layers
from specserve.models.mtp import load_mtp
from specserve.models.registry import load_model
from specserve.drafting.factory import drafter_kind
from specserve.train import data as data_module
from specserve.train.data import DataConfig, load_conversations, run_data, segment_ids
from specserve.train.draft import DraftTrainConfig, run_draft_training
from specserve.train.eagle3 import Eagle3TrainConfig, run_eagle3_training
from specserve.drafting.token_map import TOKEN_MAP_FILE, read_token_map
from specserve.train.token_map import DEFAULT_TOKEN_MAP_SIZE, frequent_tokens
from specserve.train.mtp import MTPTrainConfig, run_mtp_training
from specserve.train.prompts import PromptCounts, build_prompts

TINY = PromptCounts(math=3, code=2, explain=1, question=1, prose=2)


def test_heldout_prompts_share_no_source_with_training_ones():
    train, heldout = build_prompts(PromptCounts(math=400, code=400, explain=400, question=400, prose=400))
    assert {p.kind for p in heldout} >= {"math", "code", "explain", "prose"}
    modules = lambda ps: {p.source.split(".")[0] for p in ps if p.kind in ("code", "explain", "question")}
    assert modules(train) and modules(heldout) and not modules(train) & modules(heldout)
    assert not {p.source for p in train if p.kind == "math"} & {p.source for p in heldout if p.kind == "math"}
    # held-out passages come after every training passage of the same file
    for name in ("tinyshakespeare.txt", "sonnet.txt"):
        lines = lambda ps: [int(p.source.split(":")[1]) for p in ps if p.kind == "prose" and p.source.startswith(name)]
        if lines(heldout):
            assert max(lines(train)) < min(lines(heldout))
    assert not {p.text for p in train} & {p.text for p in heldout}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    cfg = DataConfig(target=demo_model_dir(), out=out, counts=TINY, max_tokens=12, chunk_size=4, top_k=8)
    run_data(cfg)
    return cfg


def test_recorded_states_equal_an_unpadded_forward(recorded):
    data = load_conversations(recorded.out)
    summary = json.loads((recorded.out / "training_summary.json").read_text())
    assert summary["num_prompts"] == 9 and len(summary["shards"]) == 3 and summary["tokens"] == data.num_tokens
    assert summary["minutes"] > 0 and summary["answer_tokens"] == int(data.trainable.sum())
    target = load_model(demo_model_dir(), torch.bfloat16).requires_grad_(False)
    layers = resolve_aux_layers(None, target.config.num_hidden_layers)
    assert data.aux_layers == layers
    for i in range(len(data.seq_starts) - 1):
        s, e = int(data.seq_starts[i]), int(data.seq_starts[i + 1])
        ids = data.input_ids[s:e]
        with torch.no_grad():
            final, aux = target(ids[None], torch.arange(e - s), None, layers)
            logits = target.compute_logits(final)[0].float()
        torch.testing.assert_close(data.final[s:e].float(), final[0].float(), atol=0.05, rtol=0.02)
        torch.testing.assert_close(data.aux[s:e].float(), torch.cat(aux, -1)[0].float(), atol=0.05, rtol=0.02)
        assert torch.equal(data.topk_ids[s:e, 0], logits.argmax(-1)) or \
            (logits.gather(-1, data.topk_ids[s:e, :1]).squeeze(1) >= logits.max(-1).values - 0.1).all()
        # trainable: the positions whose next token is an answer token (the answer ends the conversation)
        answer = int(data.trainable[s:e].sum())
        assert answer >= 1 and data.trainable[e - 1 - answer:e - 1].all() and not data.trainable[e - 1]
    assert torch.equal(segment_ids(data)[data.seq_starts[1:-1]], torch.arange(1, len(data.seq_starts) - 1))


def test_resume_keeps_finished_shards(recorded, monkeypatch):
    before = {p.name: p.stat().st_mtime_ns for p in recorded.out.glob("shard_*.safetensors")}
    calls = []
    monkeypatch.setattr(data_module, "generate_answers", lambda *a, **k: calls.append(a) or ([], []))
    run_data(DataConfig(target=recorded.target, out=recorded.out, counts=TINY, max_tokens=12, chunk_size=4, top_k=8,
                        resume=True))
    assert not calls
    assert before == {p.name: p.stat().st_mtime_ns for p in recorded.out.glob("shard_*.safetensors")}


def test_more_answers_per_prompt_are_sampled_rounds(tmp_path, monkeypatch):
    """Round r answers every prompt once more; only the first round has greedy answers (every third prompt
    sampled, as with one answer), so no greedy answer repeats; each answer has its own seed."""
    cfg = DataConfig(target=demo_model_dir(), out=tmp_path, counts=PromptCounts(2, 1, 1, 0, 1), max_tokens=6,
                     chunk_size=4, top_k=4, answers_per_prompt=3)
    seen = []
    real = data_module.generate_answers
    monkeypatch.setattr(data_module, "generate_answers", lambda llm, prompts, offset, n, c:
                        seen.append((prompts, offset, n)) or real(llm, prompts, offset, n, c))
    summary = run_data(cfg)
    num = summary["num_prompts"]
    assert num == 15 and summary["answers_per_prompt"] == 3 and all(n == 5 for _, _, n in seen)
    order = [p.source for prompts, _, _ in seen for p in prompts]
    assert order[:5] == order[5:10] == order[10:]
    temperatures = [data_module.answer_temperature(i, 5, cfg) for i in range(15)]
    assert temperatures[:5] == [0.0, 0.0, 0.7, 0.0, 0.0] and set(temperatures[5:]) == {0.7}
    data = load_conversations(tmp_path)
    assert data.num_tokens == summary["tokens"] and len(data.seq_starts) == 16


def test_loading_can_leave_out_the_states_a_trainer_does_not_read(recorded):
    full = load_conversations(recorded.out)
    lean = load_conversations(recorded.out, skip=("aux", "final"))
    assert lean.aux.numel() == 0 and lean.final.numel() == 0
    for name in ("input_ids", "topk_ids", "topk_logits", "trainable", "seq_starts"):
        assert torch.equal(getattr(lean, name), getattr(full, name))


def test_draft_vocabulary_is_the_most_predicted_tokens(recorded):
    data = load_conversations(recorded.out)
    vocab = frequent_tokens(data, 16, 4096)
    assert len(vocab) == 16 and torch.equal(vocab, vocab.sort().values)
    counts = torch.bincount(data.topk_ids[:, 0], minlength=4096)
    assert counts[vocab].min() >= counts[torch.tensor([t for t in range(4096) if t not in set(vocab.tolist())])].max()


def test_trainers_run_on_recorded_data(recorded, tmp_path):
    target_dir = demo_model_dir()
    target_config = ModelConfig.from_pretrained(target_dir)
    target = load_model(target_dir, torch.float32)
    e3 = run_eagle3_training(Eagle3TrainConfig(target=target_dir, out=tmp_path / "eagle3", data=recorded.out,
                                               max_steps=2, batch_size=2, seq_len=32, draft_vocab_size=256,
                                               ttt_steps=3))
    assert drafter_kind(tmp_path / "eagle3") == "eagle3" and e3["steps"] == 2 and e3["draft_vocab_size"] == 256
    head = load_eagle3_head(tmp_path / "eagle3", target.model.embed_tokens, target_config, torch.float32, "cpu", 64)
    assert head.config.draft_vocab_size == 256
    draft = run_draft_training(DraftTrainConfig(target=target_dir, data=recorded.out, out=tmp_path / "draft",
                                                hidden_size=64, num_heads=1, num_kv_heads=1, intermediate_size=128,
                                                max_steps=2, batch_size=2, seq_len=32))
    assert drafter_kind(tmp_path / "draft") == "draft" and draft["steps"] == 2
    model = load_model(tmp_path / "draft", torch.float32)
    assert model.config.vocab_size == target_config.vocab_size and model.config.hidden_size == 64
    mtp = run_mtp_training(MTPTrainConfig(target=target_dir, out=tmp_path / "mtp", data=recorded.out, max_steps=2,
                                          batch_size=2, seq_len=32))
    assert drafter_kind(tmp_path / "mtp") == "mtp" and mtp["steps"] == 2
    assert load_mtp(tmp_path / "mtp", target.config).num_layers == 1
    for name in ("eagle3", "draft", "mtp"):
        summary = json.loads((tmp_path / name / "training_summary.json").read_text())
        assert summary["minutes"] > 0 and summary["answer_tokens"] > 0
    # the draft model and MTP layers write the token map they draft over (the data's most predicted tokens)
    expected = frequent_tokens(load_conversations(recorded.out), DEFAULT_TOKEN_MAP_SIZE, target_config.vocab_size)
    for name, summary in (("draft", draft), ("mtp", mtp)):
        assert read_token_map(tmp_path / name / TOKEN_MAP_FILE, target_config.vocab_size).tolist() == expected.tolist()
        assert summary["token_map_size"] == len(expected) and 0 < summary["token_map_coverage_of_answers"] <= 1


def test_token_map_command(recorded, tmp_path, capsys):
    from specserve.train.cli import main as train_main
    train_main(["train", "token-map", "--data", str(recorded.out), "--size", "64", "--out", str(tmp_path)])
    printed = json.loads(capsys.readouterr().out)
    ids = read_token_map(tmp_path / TOKEN_MAP_FILE, 4096)
    assert printed["token_map_size"] == len(ids) == 64
    assert ids.tolist() == frequent_tokens(load_conversations(recorded.out), 64, 4096).tolist()
    with pytest.raises(SystemExit, match="--out"):
        train_main(["train", "token-map", "--data", str(recorded.out), "--out", str(tmp_path / "missing")])


def test_training_continues_from_a_saved_drafter(recorded, tmp_path):
    """--init: the draft model and MTP layers start from saved weights (the saved shape, not the flags), and
    the summary keeps the earlier run's."""
    target_dir = demo_model_dir()
    first = DraftTrainConfig(target=target_dir, data=recorded.out, out=tmp_path / "d1", hidden_size=64, num_heads=1,
                             num_kv_heads=1, intermediate_size=128, max_steps=6, batch_size=2, seq_len=32, lr=1e-2)
    before = run_draft_training(first)
    after = run_draft_training(DraftTrainConfig(target=target_dir, data=recorded.out, out=tmp_path / "d2",
                                                init=tmp_path / "d1", hidden_size=32, max_steps=2, batch_size=2,
                                                seq_len=32, seed=1))
    assert load_model(tmp_path / "d2", torch.float32).config.hidden_size == 64
    assert after["continued_from"]["steps"] == 6
    assert after["first_loss"] < before["first_loss"]
    run_mtp_training(MTPTrainConfig(target=target_dir, out=tmp_path / "m1", data=recorded.out, num_layers=2,
                                    max_steps=2, batch_size=2, seq_len=32))
    mtp = run_mtp_training(MTPTrainConfig(target=target_dir, out=tmp_path / "m2", data=recorded.out,
                                          init=tmp_path / "m1", max_steps=1, batch_size=2, seq_len=32, lr=0.0))
    assert mtp["num_layers"] == 2 and mtp["continued_from"]["steps"] == 2
    saved = lambda d: load_mtp(d, ModelConfig.from_pretrained(target_dir)).state_dict()
    assert all(torch.equal(a, b) for a, b in zip(saved(tmp_path / "m1").values(), saved(tmp_path / "m2").values()))


def test_draft_distillation_loss_is_the_topk_cross_entropy(recorded):
    from specserve.train.draft import distill_loss, draft_config, new_draft
    data = load_conversations(recorded.out)
    target = load_model(demo_model_dir(), torch.float32)
    cfg = DraftTrainConfig(target=demo_model_dir(), data=recorded.out, out=recorded.out, hidden_size=64, num_heads=1,
                           num_kv_heads=1, intermediate_size=128)
    draft = new_draft(draft_config(cfg, target.config), target, 0)
    rows = torch.arange(9)[None]
    loss = distill_loss(draft, data, rows, prompt_weight=1.0)
    hidden, _ = draft(data.input_ids[:8][None], torch.arange(8))
    log_q = F.log_softmax(draft.compute_logits(hidden)[0].float(), -1)
    p = torch.softmax(data.topk_logits[:8], -1)
    expected = -(p * log_q.gather(-1, data.topk_ids[:8])).sum(-1).mean()
    torch.testing.assert_close(loss, expected)


def test_a_saved_heads_draft_vocabulary_grows_with_init(recorded, tmp_path):
    """--init with a larger --draft-vocab-size: the head keeps its tokens and rows and gains the data's most
    predicted tokens it lacked, their rows starting from the target's head."""
    from specserve.train.token_map import ranked_tokens
    target_dir = demo_model_dir()
    target_config = ModelConfig.from_pretrained(target_dir)
    target = load_model(target_dir, torch.float32)
    small = Eagle3TrainConfig(target=target_dir, out=tmp_path / "small", data=recorded.out, max_steps=2, batch_size=2,
                              seq_len=32, draft_vocab_size=128, ttt_steps=2)
    run_eagle3_training(small)
    grown = run_eagle3_training(Eagle3TrainConfig(target=target_dir, out=tmp_path / "grown", data=recorded.out,
                                                  init=tmp_path / "small", max_steps=1, batch_size=2, seq_len=32,
                                                  draft_vocab_size=300, ttt_steps=2, lr=0.0))
    assert grown["draft_vocab_size"] == 300
    load = lambda d: load_eagle3_head(d, target.model.embed_tokens, target_config, torch.float32, "cpu", 64)
    before, after = load(tmp_path / "small"), load(tmp_path / "grown")
    old_ids = before.target_ids(torch.arange(128)).tolist()
    new_ids = after.target_ids(torch.arange(300)).tolist()
    assert new_ids == sorted(new_ids) and set(old_ids) < set(new_ids)
    ranked = [t for t in ranked_tokens(load_conversations(recorded.out), target_config.vocab_size) if t not in old_ids]
    assert set(new_ids) - set(old_ids) == set(ranked[:172])
    rows = dict(zip(new_ids, after.lm_head.weight))
    for i, t in enumerate(old_ids[:20]):
        torch.testing.assert_close(rows[t], before.lm_head.weight[i])
    for t in ranked[:20]:
        torch.testing.assert_close(rows[t], target.output_weight[t].float(), atol=1e-2, rtol=1e-2)   # saved in bf16
    cut = run_eagle3_training(Eagle3TrainConfig(target=target_dir, out=tmp_path / "cut", data=recorded.out,
                                                init=tmp_path / "grown", max_steps=0, draft_vocab_size=200,
                                                batch_size=2, seq_len=32, ttt_steps=2))
    kept = load(tmp_path / "cut").target_ids(torch.arange(200)).tolist()
    best = [t for t in ranked_tokens(load_conversations(recorded.out), target_config.vocab_size) if t in set(new_ids)]
    assert cut["draft_vocab_size"] == 200 and set(kept) == set(best[:200])
