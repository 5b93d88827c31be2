"""`specserve train demo` on a tiny corpus: the loss falls and the output loads in specserve and transformers."""
import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from specserve.models.registry import load_model
from specserve.train.demo import DemoConfig, run_demo
from specserve.train.lm import ModelSize
from specserve.train.tokenizer import render_chat

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:Mismatch dtype")

PROSE = """FIRST WATCHMAN:
Who goes there? Stand, and unfold yourself.
SECOND WATCHMAN:
Long live the king! The night is cold, and I am sick at heart."""
STDLIB_FILES = ["bisect.py", "heapq.py", "colorsys.py", "keyword.py", "fnmatch.py", "shlex.py", "textwrap.py"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("demo")
    code = root / "code"
    code.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in STDLIB_FILES:
        shutil.copyfile(stdlib / name, code / name)
    (root / "prose.txt").write_text("\n\n".join([PROSE] * 40))
    cfg = DemoConfig(
        sources=[code, root / "prose.txt"], out=root / "model", vocab_size=320,
        target=ModelSize(64, 2, 2, 1, 128, head_dim=32), draft=ModelSize(32, 1, 1, 1, 64, head_dim=32),
        max_steps=40, batch_size=4, seq_len=64, target_lr=3e-3, draft_lr=3e-3, heldout_fraction=0.2,
        max_positions=256, dtype=torch.float32, eval_windows=4, seed=0,
    )
    summary = run_demo(cfg)
    return cfg.out, summary


def test_loss_falls(trained):
    _, summary = trained
    assert summary["target_train_loss"] < summary["target_first_loss"] - 0.5
    assert summary["draft_train_kl"] < summary["draft_first_kl"]


def test_hf_layout(trained):
    out, _ = trained
    for folder in (out, out / "draft"):
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            assert (folder / name).exists(), folder / name
    assert json.loads((out / "heldout.json").read_text())
    assert ".ckpt/" in (out / ".gitignore").read_text()
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2, 0]


@pytest.mark.parametrize("sub", ["", "draft"])
def test_logits_match_transformers(trained, sub):
    folder = trained[0] / sub
    ours = load_model(folder, torch.float32)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, ours.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden, _ = ours(ids, torch.arange(ids.shape[1]))
        expected = theirs(ids).logits
    assert (ours.compute_logits(hidden) - expected).abs().max().item() <= 1e-4


def test_tokenizer_loads_in_transformers(trained):
    out, _ = trained
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "def add(a, b):"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == render_chat(messages, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    ids = tokenizer(rendered)["input_ids"]
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.decode(ids) == rendered
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"


def test_resume_continues_the_same_run(tmp_path):
    from specserve.train.demo import next_token_loss
    from specserve.train.lm import build_model, hf_config
    from specserve.train.trainer import StageConfig, train_stage

    tokens = torch.randint(0, 64, (4000,), generator=torch.Generator().manual_seed(0)).int()
    config = hf_config(ModelSize(32, 1, 1, 1, 64, head_dim=32), 64, 128, torch.float32)
    cfg = StageConfig("t", minutes=1.0, max_steps=12, batch_size=2, seq_len=16, checkpoint_minutes=0.0, bf16=False)

    straight = build_model(config, seed=0)
    train_stage(cfg, straight, lambda b: next_token_loss(straight, b), tokens, tmp_path / "a.pt", resume=False)

    interrupted = build_model(config, seed=0)
    calls = 0

    def failing_loss(batch):
        nonlocal calls
        calls += 1
        if calls == 7:
            raise KeyboardInterrupt
        return next_token_loss(interrupted, batch)

    with pytest.raises(KeyboardInterrupt):
        train_stage(cfg, interrupted, failing_loss, tokens, tmp_path / "b.pt", resume=False)
    resumed = build_model(config, seed=1)
    state = train_stage(cfg, resumed, lambda b: next_token_loss(resumed, b), tokens, tmp_path / "b.pt", resume=True)
    assert state.step == 12 and state.done
    for a, b in zip(straight.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
