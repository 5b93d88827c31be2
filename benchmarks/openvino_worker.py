"""OpenVINO GenAI's side of bench_decode.py, run by the Python that has openvino_genai installed (a separate
venv: see ../shared/PERF-NOTES.md or benchmarks/NOTES.md for the install and export commands).

    <venv>/bin/python benchmarks/openvino_worker.py OV_MODEL_DIR THREADS NEW_TOKENS

Reads one JSON line, the prompts as strings with the chat template already applied (so both engines see the same
text), then answers each further line with one timed round: every prompt once, batch 1, greedy, exactly
NEW_TOKENS new tokens (min_new_tokens: EOS ignored), the generated tokens per second (as OpenVINO counts them)
on one line, as bench_decode's runners do.
"""
import json
import sys
import time

import openvino_genai


def main() -> None:
    model_dir, threads, new_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    prompts = json.loads(sys.stdin.readline())
    pipe = openvino_genai.LLMPipeline(model_dir, "CPU", INFERENCE_NUM_THREADS=threads)
    config = openvino_genai.GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                             do_sample=False)
    config.apply_chat_template = False               # the prompts are already templated
    pipe.generate(prompts[0], config)                # warm-up
    print("ready", flush=True)
    for _ in sys.stdin:
        start, tokens = time.perf_counter(), 0
        for prompt in prompts:
            tokens += pipe.generate([prompt], config).perf_metrics.get_num_generated_tokens()
        print(tokens / (time.perf_counter() - start), flush=True)


if __name__ == "__main__":
    main()
