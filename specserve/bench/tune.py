"""`specserve tune`: measure where tokens/s stops improving and make that num_assistant_tokens the default."""
import argparse
import json
import shutil
from pathlib import Path

from specserve.bench.sweep import SweepPoint, add_speedups, format_table, sweep_points, write_results


def pick_num_assistant_tokens(points: list[SweepPoint], tolerance: float) -> int:
    """The smallest k whose tokens/s is within `tolerance` (a fraction) of the best: past it, drafting more
    buys nothing measurable."""
    points = [p for p in points if isinstance(p.num_assistant_tokens, int)]      # a number to write down
    best = max(p.output_throughput for p in points)
    return min(p.num_assistant_tokens for p in points if p.output_throughput >= (1 - tolerance) * best)


def write_generation_config(model_dir: Path, num_assistant_tokens: int) -> Path | None:
    """Sets num_assistant_tokens in generation_config.json; the file as it was goes to
    generation_config.json.bak first. Returns the backup's path, None if there was no file."""
    path = model_dir / "generation_config.json"
    config, backup = {}, None
    if path.is_file():
        config = json.loads(path.read_text())
        backup = path.with_name(path.name + ".bak")
        shutil.copy2(path, backup)
    config["num_assistant_tokens"] = num_assistant_tokens
    path.write_text(json.dumps(config, indent=2) + "\n")
    return backup


def run_tune(args: argparse.Namespace) -> int:
    """With --method, launches the model with that method; otherwise measures the server already running it."""
    points = sweep_points(args, [args.method] if args.method else None, args.num_assistant_tokens,
                          skip_unavailable=False)
    add_speedups(points)
    print(format_table(points))
    write_results(points, Path(args.result_dir), name="tune")
    best = max(points, key=lambda p: p.output_throughput)
    chosen = pick_num_assistant_tokens(points, args.tolerance)
    print(f"Best: {best.output_throughput:.2f} tok/s at num_assistant_tokens={best.num_assistant_tokens}; "
          f"tokens/s stops improving (within {args.tolerance:.0%}) at num_assistant_tokens={chosen}")
    if chosen == 0:
        print("Speculative decoding does not pay here: the default becomes 0 (drafting off).")
    backup = write_generation_config(Path(args.model), chosen)
    print(f"Wrote num_assistant_tokens={chosen} to {Path(args.model) / 'generation_config.json'}"
          + (f" (previous version: {backup})" if backup else ""))
    return chosen
