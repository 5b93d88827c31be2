"""Issue 12: training checkpoints are safetensors with a JSON header; resuming unpickles nothing."""
from __future__ import annotations

import math
import pickle
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import specserve.train
from specserve.train.checkpoint import load_state, save_state
from specserve.train.demo import next_token_loss
from specserve.train.lm import ModelSize, build_model, hf_config
from specserve.train.trainer import StageConfig, StageState, make_optimizer, optimizer_step, save_checkpoint

CONFIG = hf_config(ModelSize(32, 1, 1, 1, 64, head_dim=32), 64, 128, torch.float32)    # tied embeddings


def trained_pair():
    torch.manual_seed(0)
    model = build_model(CONFIG, seed=0)
    cfg = StageConfig(name="t", minutes=1, batch_size=2, seq_len=16, bf16=False)
    optimizer = make_optimizer(model, cfg)
    batch = torch.randint(0, 64, (2, 17))
    for _ in range(2):
        optimizer_step(cfg, model, optimizer, lambda b: next_token_loss(model, b), batch, 1e-3)
    return cfg, model, optimizer, batch


def test_a_training_state_round_trips(tmp_path):
    cfg, model, optimizer, batch = trained_pair()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "state": {"step": 2, "losses": [1.5, math.inf, math.nan], "done": False, "name": None},
             "betas": (0.9, 0.95), "by_int": {0: "a", 7: torch.arange(3)}, "tensor": {"tensor": "not a marker"}}
    path = tmp_path / "stage.safetensors"
    save_state(path, state)
    loaded = load_state(path)
    assert loaded["model"].keys() == state["model"].keys()
    assert all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items())
    assert loaded["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]   # tuples stay tuples
    assert sorted(loaded["optimizer"]["state"]) == sorted(state["optimizer"]["state"])  # int keys stay ints
    assert loaded["state"]["losses"][:2] == [1.5, math.inf] and math.isnan(loaded["state"]["losses"][2])
    assert loaded["betas"] == (0.9, 0.95) and loaded["by_int"][0] == "a" and torch.equal(loaded["by_int"][7], torch.arange(3))
    assert loaded["tensor"] == {"tensor": "not a marker"}

    # the loaded optimizer continues exactly as the original one
    twin = build_model(CONFIG, seed=5)
    twin.load_state_dict(loaded["model"])
    twin_optimizer = make_optimizer(twin, cfg)
    twin_optimizer.load_state_dict(loaded["optimizer"])
    for m, o in ((model, optimizer), (twin, twin_optimizer)):
        optimizer_step(cfg, m, o, lambda b, m=m: next_token_loss(m, b), batch, 1e-3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_a_stage_checkpoint_is_safetensors_not_a_pickle(tmp_path):
    _, model, optimizer, _ = trained_pair()
    path = tmp_path / "stage.safetensors"
    save_checkpoint(path, model, optimizer, StageState(step=2, losses=[1.0, 0.5]))
    raw = path.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    assert raw[8:9] == b"{" and header_len < len(raw)        # safetensors: a length, then a JSON header
    with pytest.raises(pickle.UnpicklingError):
        pickle.loads(raw)
    with safe_open(str(path), framework="pt") as f:
        assert "specserve.state" in f.metadata()
    assert load_state(path)["state"]["step"] == 2


class Exploit:
    def __reduce__(self):
        return (Path.touch, (Path(self.target),))


def test_a_pickle_at_the_checkpoint_path_is_refused_unexecuted(tmp_path):
    exploit = Exploit()
    exploit.target = str(tmp_path / "pwned")
    path = tmp_path / "stage.safetensors"
    path.write_bytes(pickle.dumps({"model": exploit}))
    with pytest.raises(Exception):
        load_state(path)
    assert not (tmp_path / "pwned").exists()


def test_nothing_in_training_unpickles():
    for source in Path(specserve.train.__file__).parent.glob("*.py"):
        for call in re.findall(r"torch\.load\([^)]*\)", source.read_text()):
            assert "weights_only=True" in call, f"{source.name}: {call}"


def test_a_stalled_step_counts_as_the_recent_median():
    """A suspended process (SIGSTOP while a benchmark runs) must not spend the time budget nor, through the
    plan, push the schedule's progress (which never goes back) to its end."""
    from collections import deque
    from specserve.train.trainer import stall_free
    recent = deque([1.0, 1.2, 0.9, 1.1] * 5)
    assert stall_free(700.0, recent) == pytest.approx(1.05) and stall_free(3.0, recent) == 3.0
    assert stall_free(700.0, deque([1.0] * 5)) == 700.0          # too few steps to tell
