"""`specserve serve` flags, config files, start-up checks, API keys, admission and Ctrl-C."""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from conftest import make_checkpoint
from specserve.config import EngineConfig
from specserve.engine.async_engine import AsyncEngine, EngineOverloadedError
from specserve.engine.llm_engine import LLMEngine
from specserve.sampling_params import SamplingParams
from specserve.server.api_server import build_app, run_server
from specserve.cli_args import engine_config_from_args
from specserve.server.cli import add_serve_parser, resolve_serve_args


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="specserve")
    serve = add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return resolve_serve_args(parser.parse_args(["serve", *argv]), serve)


def test_defaults_flags_and_engine_config(tmp_path):
    args = parse([])
    assert (args.host, args.port, args.model, args.max_queue_len) == ("127.0.0.1", 8000, None, 256)
    config = engine_config_from_args(args)
    assert config == EngineConfig()
    args = parse([str(tmp_path), "--port", "9001", "--speculative-method", "ngram", "--max-ngram-size", "5",
                  "--no-prefix-caching", "--kv-cache-memory-gb", "0.5", "--served-model-name", "a", "b",
                  "--num-assistant-tokens", "7", "--dtype", "bfloat16", "--max-num-seqs", "4", "--kv-cache-dtype", "int8",
                  "--speculative-catch-up-window", "0"])
    config = engine_config_from_args(args)
    assert (config.model, config.speculative_method, config.draft_options["prompt_lookup_max"], config.enable_prefix_caching,
            config.kv_cache_memory_gb, config.num_assistant_tokens, config.dtype, config.max_num_seqs,
            config.kv_cache_dtype, config.speculative_catch_up_window) == (str(tmp_path), "ngram", 5, False, 0.5, 7, "bfloat16",
                                                                          4, "int8", 0)
    assert args.port == 9001 and args.served_model_name == ["a", "b"]


@pytest.mark.parametrize("argv, flag", [
    (["--num-assistant-tokens", "99"], "--num-assistant-tokens"),
    (["--port", "http"], "--port"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--kv-cache-memory-gb", "-1"], "--kv-cache-memory-gb"),
    (["--speculative-method", "medusa"], "--speculative-method"),
    (["--tree-depth", "-1"], "--tree-depth"),
    (["--kv-cache-dtype", "fp4"], "--kv-cache-dtype"),
    (["--speculative-catch-up-window", "-1"], "--speculative-catch-up-window"),
])
def test_bad_flags_name_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit:
        parse(argv)
    assert exit.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


def test_config_file_fills_unset_flags(tmp_path, capsys):
    (tmp_path / "drafter").mkdir()
    config = tmp_path / "serve.json"
    config.write_text(json.dumps({"draft_models_path": "drafter", "port": 9100, "max-num-seqs": 3,
                                  "enable_prefix_caching": False, "served_model_name": "m"}))
    args = parse(["--config", str(config), "--port", "9200"])
    assert args.draft_model == str(tmp_path / "drafter") and args.max_num_seqs == 3
    assert args.port == 9200 and args.no_prefix_caching and args.served_model_name == ["m"]
    config.write_text(json.dumps({"draft_model_path": "x"}))
    with pytest.raises(SystemExit):
        parse(["--config", str(config)])
    assert "unknown key 'draft_model_path'" in capsys.readouterr().err
    config.write_text(json.dumps({"max_num_seqs": 0}))
    with pytest.raises(SystemExit):
        parse(["--config", str(config)])
    assert "argument --max-num-seqs: must be >= 1" in capsys.readouterr().err


def test_mismatched_drafter_stops_start_up(tmp_path, qwen3_dir, capsys):
    make_checkpoint(tmp_path / "other_vocab", "qwen3", vocab_size=300)
    with pytest.raises(SystemExit) as exit:
        run_server(parse([str(qwen3_dir), "--draft-model", str(tmp_path / "other_vocab")]))
    assert exit.value.code == 1
    assert "does not share the target's tokenizer" in capsys.readouterr().err


def test_bad_token_map_stops_start_up(tmp_path, qwen3_dir, capsys):
    (tmp_path / "map.json").write_text("[1, 2, 99999]")
    with pytest.raises(SystemExit) as exit:
        run_server(parse([str(qwen3_dir), "--speculative-method", "ngram", "--speculative-token-map", "x.json"]))
    assert exit.value.code == 1 and "--speculative-token-map applies to the draft and mtp" in capsys.readouterr().err
    make_checkpoint(tmp_path / "draft", "qwen3")
    with pytest.raises(SystemExit):
        run_server(parse([str(qwen3_dir), "--draft-model", str(tmp_path / "draft"),
                          "--speculative-token-map", str(tmp_path / "map.json")]))
    assert "map.json must list token ids in [0, 400)" in capsys.readouterr().err


def test_unservable_tree_default_stops_start_up(qwen3_dir, capsys):
    with pytest.raises(SystemExit):
        run_server(parse([str(qwen3_dir), "--speculative-method", "ngram", "--tree-depth", "2"]))
    assert "tree_depth=2" in capsys.readouterr().err


def test_api_key_and_kv_budget(qwen3_dir):
    engine = LLMEngine(EngineConfig(model=qwen3_dir, kv_cache_memory_gb=0.0001, speculative_method="none"))
    assert engine.max_num_tokens < 300
    with TestClient(build_app(AsyncEngine(engine), "m", api_key="sekret")) as client:
        body = {"prompt": "def", "max_tokens": 4}
        assert client.post("/v1/completions", json=body).status_code == 401
        wrong = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        auth = {"Authorization": "Bearer sekret"}
        assert client.post("/v1/completions", json=body, headers=auth).status_code == 200
        assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200
        too_long = client.post("/v1/completions", json={"prompt": [5] * 300}, headers=auth)
        assert too_long.status_code == 400 and "KV cache" in too_long.json()["error"]["message"]


def test_generation_config_fills_what_the_request_leaves_unset(tmp_path, qwen3_dir):
    import shutil
    model = shutil.copytree(qwen3_dir, tmp_path / "m")
    shutil.copytree(qwen3_dir, model / "draft")         # found beside the model; accepts every draft token
    (model / "generation_config.json").write_text(json.dumps(
        {"do_sample": False, "max_new_tokens": 7, "num_assistant_tokens": 2}))
    engine = LLMEngine(EngineConfig(model=model, kv_cache_memory_gb=0.01))
    prompt = "The quick brown fox"
    with TestClient(build_app(AsyncEngine(engine), "m")) as client:
        def complete(**body) -> dict:
            return client.post("/v1/completions", json={"prompt": prompt, "ignore_eos": True, **body}).json()

        first, again = complete(), complete()
        assert first["choices"][0]["text"] == again["choices"][0]["text"]      # greedy: do_sample is false
        assert first["usage"]["completion_tokens"] == 7
        assert first["usage"]["accepted_per_position"] == [first["usage"]["num_drafts"]] * 2
        wider = complete(max_tokens=12, num_assistant_tokens=4, max_ngram_size=2)["usage"]
        assert wider["completion_tokens"] == 12 and len(wider["accepted_per_position"]) > 2


def test_admission_is_bounded_and_cancelling_aborts(qwen3_dir):
    engine = LLMEngine(EngineConfig(model=qwen3_dir, kv_cache_memory_gb=0.01, max_num_seqs=1,
                                    speculative_method="none"))
    async_engine = AsyncEngine(engine, max_queue_len=1)
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def drained():
        for _ in range(500):
            if async_engine.num_in_flight == 0:
                return
            await asyncio.sleep(0.01)

    async def scenario():
        async_engine.start()
        first = await async_engine.add_request([5, 6, 7], long, "a")
        second = await async_engine.add_request([5, 6, 8], long, "b")
        with pytest.raises(EngineOverloadedError, match="capacity"):
            await async_engine.add_request([5, 6, 9], long, "c")
        out = await anext(first)
        assert out.request_id == "a" and out.new_token_ids
        first.close()
        second.close()
        await drained()
        outputs = [out async for out in async_engine.generate([5, 6, 10], SamplingParams(max_tokens=3), "d")]
        assert outputs[-1].finished and sum(len(o.new_token_ids) for o in outputs) == 3
        gen = async_engine.generate([5, 6, 11], long, "e")
        await anext(gen)
        await gen.aclose()                     # what a client disconnect does
        await drained()
        await async_engine.add_request([5, 6, 12], long, "f")    # left running when this event loop closes

    try:
        asyncio.run(scenario())
        deadline = time.time() + 10
        while async_engine.num_in_flight and time.time() < deadline:
            time.sleep(0.01)
        assert async_engine.dead is None       # an abandoned caller's request is aborted, the engine lives on
    finally:
        async_engine.shutdown()
    assert async_engine.num_in_flight == 0 and not engine.requests
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_ctrl_c_shuts_down_cleanly(qwen3_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "specserve.server.cli", "serve", str(qwen3_dir), "--port", str(port),
                             "--kv-cache-memory-gb", "0.01", "--speculative-method", "ngram"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() else "timeout"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "def", "max_tokens": 4})
        assert response.status_code == 200
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert "speculative method: ngram" in out and "Application shutdown complete" in out
