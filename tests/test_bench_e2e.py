"""bench serve, bench sweep and tune against a live `specserve serve` running the demo model."""
import json
import shutil
from pathlib import Path

import pytest

from specserve.bench.cli import build_parser
from specserve.bench.launch import launched_server
from specserve.bench.serve import run_serve
from specserve.bench.sweep import run_sweep
from specserve.bench.tune import run_tune
from specserve.config import demo_model_dir
from specserve.server import cli as server_cli  # noqa: F401  (a server that fails to import fails these tests)

# Short sonnet prompts and greedy, EOS-ignoring outputs keep each run to seconds on a CPU.
PROMPTS = ["--dataset-name", "sonnet", "--sonnet-input-len", "300", "--sonnet-prefix-len", "100",
           "--output-len", "16", "--temperature", "0", "--ignore-eos", "--disable-tqdm"]


def parse(argv: list[str]):
    return build_parser().parse_args(argv)


@pytest.fixture(scope="module")
def demo_model() -> Path:
    path = Path(demo_model_dir())
    assert (path / "config.json").is_file(), f"no demo model at {path}"
    return path


@pytest.fixture(scope="module")
def ngram_server(demo_model, tmp_path_factory) -> str:
    log_path = tmp_path_factory.mktemp("server") / "ngram.log"
    with launched_server(str(demo_model), "ngram", log_path, timeout_s=300) as base_url:
        yield base_url


def test_bench_serve_prints_the_block_and_the_speculative_section(ngram_server, capsys):
    # vLLM's sonnet defaults: 550 input tokens (200 shared), 150 output
    result = run_serve(parse(["bench", "serve", "--base-url", ngram_server, "--num-prompts", "5",
                              "--max-concurrency", "1", "--temperature", "0", "--ignore-eos", "--disable-tqdm"]))
    text = capsys.readouterr().out
    assert "============ Serving Benchmark Result ============" in text
    assert result["completed"] == 5 and result["failed"] == 0, result["errors"]
    assert result["total_output_tokens"] == 5 * 150 and all(n <= 550 for n in result["input_lens"])
    assert result["output_throughput"] > 0 and result["request_throughput"] > 0 and result["mean_ttft_ms"] > 0
    assert "---------------Speculative Decoding---------------" in text
    assert result["spec_decode_acceptance_length"] >= 1.0
    assert 0 <= result["spec_decode_acceptance_rate"] <= 100
    # the server's default num_assistant_tokens is "auto": the lengths it chose, from each request's usage
    assert "Mean chosen draft length:" in text and "Decode steps drafting (%):" in text
    assert 0 <= result["mean_draft_length"] <= 8 and 0 <= result["drafting_fraction"] <= 1


def test_bench_sweep_over_one_server_writes_table_and_plot(ngram_server, tmp_path, capsys):
    points = run_sweep(parse(["bench", "sweep", "--base-url", ngram_server, "--num-prompts", "2",
                              "--num-assistant-tokens", "0,3", "--label", "ngram",
                              "--result-dir", str(tmp_path), *PROMPTS]))
    plain, drafting = points
    assert plain.tokens_per_step == pytest.approx(1.0) and plain.speedup == pytest.approx(1.0)
    assert drafting.acceptance_length is not None and drafting.tokens_per_step >= 1.0
    assert all(p.output_throughput > 0 and p.failed == 0 for p in points)
    assert "speedup" in capsys.readouterr().out
    assert (tmp_path / "sweep.csv").read_text().count("\n") == 3
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_sweep_over_concurrency_compares_auto_with_fixed_k(ngram_server, tmp_path, capsys):
    points = run_sweep(parse(["bench", "sweep", "--base-url", ngram_server, "--num-prompts", "2",
                              "--prompts-per-concurrency", "2", "--concurrency", "1,2",
                              "--num-assistant-tokens", "0,3,auto", "--label", "ngram",
                              "--result-dir", str(tmp_path), *PROMPTS]))
    assert [(p.num_assistant_tokens, p.concurrency) for p in points] == \
        [(0, 1), (3, 1), ("auto", 1), (0, 2), (3, 2), ("auto", 2)]
    assert [p.completed for p in points] == [2, 2, 2, 4, 4, 4]
    auto = [p for p in points if p.num_assistant_tokens == "auto"]
    assert all(p.mean_draft_length is not None and p.speedup is not None for p in auto)
    out = capsys.readouterr().out
    assert "| ngram | 2 |" in out and "auto / max(plain, best k)" in out
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_sweep_launches_each_method(demo_model, tmp_path, capsys):
    points = run_sweep(parse(["bench", "sweep", "--model", str(demo_model), "--methods", "none,ngram",
                              "--num-prompts", "2", "--num-assistant-tokens", "0,3", "--repeats", "2",
                              "--result-dir", str(tmp_path), *PROMPTS]))
    assert [(p.method, p.num_assistant_tokens) for p in points] == [("none", 0), ("ngram", 3)]
    assert [p.block for p in points] == ["ngram", "ngram"] and all(len(p.runs) == 2 for p in points)
    starts = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Starting:")]
    assert len(starts) == 2 and all("--no-prefix-caching --no-ngram-cache" in line for line in starts)
    assert points[0].acceptance_length is None and points[1].speedup is not None
    assert (tmp_path / "sweep.png").is_file() and (tmp_path / "server-ngram.log").is_file()


def test_tune_writes_the_measured_default(ngram_server, demo_model, tmp_path):
    model_copy = tmp_path / "model"   # the running server measures; the copy gets the result
    model_copy.mkdir()
    for path in demo_model.iterdir():
        if path.is_file():
            shutil.copy2(path, model_copy)
    original = model_copy / "generation_config.json"
    had_config = original.is_file()
    old_text = original.read_text() if had_config else None
    chosen = run_tune(parse(["tune", "--base-url", ngram_server, "--model", str(model_copy), "--num-prompts", "2",
                             "--num-assistant-tokens", "0,3", "--result-dir", str(tmp_path / "tune"), *PROMPTS]))
    assert chosen in (0, 3)
    assert json.loads(original.read_text())["num_assistant_tokens"] == chosen
    if had_config:
        assert (model_copy / "generation_config.json.bak").read_text() == old_text
